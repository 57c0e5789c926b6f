"""The host KV tier on the GPU (`python -m benchmarks.gpu_kv_offload`), issue 34 item 6.

1. PCIe: pinned host <-> device copy bandwidth of one 1 GiB buffer each way (the reference).
2. The tier's copies: `HostKVStore.execute` saving then loading N pages of the engine's own arena (the pages of
   a 32K-token session of the shape), bytes over time, against (1).
3. A returning session: gemma3-4b at random bf16 weights; session A (a `--context`-token prompt and a short
   answer), then session B of the same length evicts A from a device pool that holds about one session, then A
   returns with 32 new tokens. Time to first token of A's return with the tier (`--kv-offload-memory`) against
   recomputation (the same engine settings without it), and the greedy tokens of both (equal).

`--device cpu --tiny` runs the same sections on a tiny shape on the CPU (what a test checks). Writes
$OUT/gpu_kv_offload.json after every section.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

GiB = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, reps: int = 5) -> float:
    """Median seconds of fn() (after one warm-up)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def pcie(device: torch.device, nbytes: int) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), device)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), device)
    return {"bytes": nbytes, "d2h_GBps": round(nbytes / d2h / 1e9, 2), "h2d_GBps": round(nbytes / h2d / 1e9, 2)}


def _engine(loaded, device: torch.device, pool: int, tier: int | None, chunk: int):
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM

    return LLM.from_config(EngineConfig(model=loaded.source.name, device=device.type,
                                        dtype="bfloat16" if device.type == "cuda" else "float32",
                                        kv_cache_memory=pool, kv_offload_memory=tier, max_num_batched_tokens=chunk,
                                        max_num_seqs=8, enforce_eager=device.type != "cuda"), loaded)


def _request(engine, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(time to first token, tokens, cached prompt tokens) of one request alone."""
    from gemmaserve.engine.sampling_params import SamplingParams

    device = torch.device(engine.info.device)
    _sync(device)
    start = time.perf_counter()
    rid = engine.add_request("", SamplingParams(max_tokens=max_tokens, ignore_eos=True), prompt_ids=prompt)
    first, out = None, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                out = o
                if first is None and o.outputs[0].token_ids:
                    first = time.perf_counter() - start
    return first, list(out.outputs[0].token_ids), out.num_cached_tokens


def store_copies(llm, device: torch.device, context: int) -> dict:
    """Save then load the pages a `context`-token session holds, through the runner's store."""
    from gemmaserve.kv.connector import BlockCopy, Direction, KVTransfers

    parts = llm.engine.internals()
    runner = getattr(parts.runner, "runner", parts.runner)
    kv = parts.kv
    pages = min(kv.pages_at(context), kv.num_pages, kv.tier.num_pages)
    perm = random.Random(0).sample(range(kv.num_pages), pages)   # scattered pages, as a pool's are
    save = KVTransfers([BlockCopy(Direction.SAVE, 0, perm, list(range(pages)))])
    load = KVTransfers([BlockCopy(Direction.LOAD, 0, perm, list(range(pages)))])
    nbytes = pages * kv.page_bytes
    t_save = _timed(lambda: runner.host_kv.execute(save), device)
    t_load = _timed(lambda: runner.host_kv.execute(load), device)
    return {"pages": pages, "bytes": nbytes, "save_GBps": round(nbytes / t_save / 1e9, 2),
            "load_GBps": round(nbytes / t_load / 1e9, 2), "save_ms": round(1e3 * t_save, 2),
            "load_ms": round(1e3 * t_load, 2)}


def returning_session(loaded, device: torch.device, context: int, chunk: int) -> tuple[dict, object]:
    vocab = loaded.model.vocab_size
    rng = random.Random(1)
    a = [2] + [rng.randrange(3, vocab) for _ in range(context - 1)]
    b = [2] + [rng.randrange(3, vocab) for _ in range(context - 1)]
    new = [rng.randrange(3, vocab) for _ in range(32)]
    probe = _engine(loaded, device, 256 << 20, None, chunk)
    kv = probe.engine.internals().kv
    per_session = kv.pages_at(context + 64) * kv.page_bytes
    pool = max(int(1.2 * per_session), kv.peak_pages(context + 64, chunk) * kv.page_bytes)
    del probe
    rows, tiered = {}, None
    for name, tier in (("recompute", None), ("tier", 2 * per_session)):
        llm = _engine(loaded, device, pool, tier, chunk)
        _request(llm.engine, a[:512], 1)   # warm-up
        llm.reset_prefix_cache()
        ttft_a, answer, _ = _request(llm.engine, a, 8)
        _request(llm.engine, b, 8)        # evicts A from the device
        ret = a + answer + new
        ttft, tokens, cached = _request(llm.engine, ret, 8)
        rows[name] = {"first_ttft_ms": round(1e3 * ttft_a, 1), "return_ttft_ms": round(1e3 * ttft, 1),
                      "return_cached_tokens": cached, "tokens": tokens}
        if tier is not None:
            st = llm.engine.snapshot().tier
            rows[name].update(saved_blocks=st.saved_blocks, loaded_blocks=st.loaded_blocks, tier_bytes=st.bytes_used)
            tiered = llm
        else:
            del llm
    same = rows["recompute"].pop("tokens") == rows["tier"].pop("tokens")
    return {"context": context, "pool_bytes": pool, "same_tokens": same, **rows,
            "return_ttft_ratio": round(rows["tier"]["return_ttft_ms"] / rows["recompute"]["return_ttft_ms"], 3)}, tiered


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="a tiny shape and context (CPU tests)")
    ap.add_argument("--context", type=int, default=32768, help="session prompt tokens")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    from gemmaserve.testing.synthetic import random_model

    out_dir = Path(os.environ.get("OUT", "bench-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "date": time.strftime("%Y-%m-%d")}

    def save() -> None:
        (out_dir / "gpu_kv_offload.json").write_text(json.dumps(res, indent=1))

    shape = "gemma4-tiny" if args.tiny else "gemma3-4b"
    context = 1024 if args.tiny else args.context
    res["pcie"] = pcie(device, (64 << 20) if args.tiny else GiB)
    print("pcie", res["pcie"], flush=True)
    save()
    loaded = random_model(shape, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    res["session"], llm = returning_session(loaded, device, context, 512 if args.tiny else 8192)
    print("session", res["session"], flush=True)
    save()
    res["store"] = store_copies(llm, device, context)
    res["store"]["vs_pcie"] = {"save": round(res["store"]["save_GBps"] / res["pcie"]["d2h_GBps"], 3),
                               "load": round(res["store"]["load_GBps"] / res["pcie"]["h2d_GBps"], 3)}
    print("store", res["store"], flush=True)
    save()
    return 0 if res["session"]["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
