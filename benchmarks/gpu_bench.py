"""GPU benchmark (`python -m benchmarks.gpu_bench [sections]`), random weights at real Gemma 3
sizes, bf16. Sections (default: all):

  roofline    decode step time at batch 1 for gemma3-1b/4b/27b shapes, against the roofline: bytes of
              weights + KV read per step over the HBM copy bandwidth measured in the same run
  throughput  gemma3-4b output tokens/s at batch 64 and 256 (prompt 1024, 128 new tokens) against
              Hugging Face generate on the same weights (sdpa, bf16)
  attention   decode attention bandwidth at contexts 4K..128K (from gpu_check)
  prefill     prefill tokens/s of one 8K prompt (gemma3-4b)
  pressure    KV budget capped, prompts of 8K-32K: throughput with V1, V2 and V2 + scratch
  profile     GPU time per kernel of one eager batch-1 decode step (gemma3-1b, 4b): where the time goes
  engine      the engine core (issue 11), asynchronous scheduling off and on, same run: decode step
              against its graph replay at batch 1 and 64 (and batch 1 against the roofline), batch-64
              and 256 throughput, host time per decode step at 64 x 1K and 64 x 16K contexts
  first       the first 32K-token prompt after startup against the second (run it first, in a fresh
              process on a fresh machine: Triton's disk cache would hide compilation)
  invariant   the cost of `--batch-invariant` (issue 34) on gemma3-4b, off and on in the same run: decode
              step and graph replay at batch 1 and 64 (1K context) and 1 and 8 (16K), prefill of an 8K
              prompt, batch-64 throughput; and the check itself at real size (a 1K-token probe's logits
              alone, duplicated, among 63 others): fails the run (exit 1) if "on" is not bitwise the same
  invariant-moe  the same on gemma4-26b-a4b (MoE experts on the grouped invariant GEMM)

Writes $OUT/gpu_bench.json after every section (so a timeout keeps what finished); a table last.
"""

from __future__ import annotations

import bisect
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from gemmaserve.bench.gpu_check import copy_bandwidth, decode_bandwidth
from gemmaserve.bench.sections import exit_status, release_device_memory, run_sections
from gemmaserve.testing.synthetic import random_model

GiB = 1 << 30


def _engine(loaded, **opts):
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM

    opts.setdefault("kv_cache_memory", 24 * GiB)
    opts.setdefault("max_num_seqs", 256)
    opts.setdefault("max_num_batched_tokens", 8192)
    return LLM.from_config(EngineConfig(model=loaded.source.name, device="cuda", dtype="bfloat16", **opts), loaded)


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[2] + [rng.randrange(3, vocab) for _ in range(length - 1)] for _ in range(n)]


def _run_all(llm, prompts: list[list[int]], new_tokens: int) -> float:
    """Wall seconds to complete every prompt (prefill included)."""
    from gemmaserve.engine.sampling_params import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for p in prompts:
        eng.add_request("", params, prompt_ids=p)
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def engine_step_ms(eng, steps: int) -> float:
    """Wall milliseconds per `eng.step()` over `steps` steps (host and device: the device synchronised around)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def replay_ms(graph: torch.cuda.CUDAGraph, steps: int) -> float:
    """GPU milliseconds per replay of a captured graph (device time only, no host in between)."""
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(steps):
        graph.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / steps


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def batch1_decode(llm, model, steps: int = 100) -> tuple[float, float, int]:
    """One sequence decoding after a 1K-token prompt: (engine step ms, its captured graph's replay ms, KV bytes a
    step reads at the measured context)."""
    from gemmaserve.engine.sampling_params import SamplingParams

    eng = llm.engine
    prompt = _prompts(1, 1024, model.config.vocab_size)[0]
    _run_all(llm, [prompt], 8)   # warm-up: compiles kernels, captures the batch-1 graph
    eng.add_request("", SamplingParams(max_tokens=200, ignore_eos=True), prompt_ids=prompt)
    for _ in range(5):
        eng.step()
    step_ms = engine_step_ms(eng, steps)
    graph_ms = replay_ms(eng.internals().runner.graphs.graph(1), steps)   # pure GPU time of the captured decode graph
    while eng.has_unfinished_requests():
        eng.step()
    ctx = 1024 + 5 + steps
    kv_bytes = sum(s.bytes_per_token() * (min(ctx, s.window) if s.window else ctx)
                   for s in model.kv_layer_specs(torch.bfloat16))
    return step_ms, graph_ms, kv_bytes


def _roofline_row(name: str, hbm: float) -> dict:
    """One shape's batch-1 decode step against its roofline. A function of its own: everything it made
    (weights, KV, the captured graph and its memory pool) is garbage when it returns, before the next
    shape loads (the 27B's graph, still referenced by a loop variable, left the next section out of memory)."""
    loaded = random_model(name, torch.bfloat16, torch.device("cuda"))
    llm = _engine(loaded, kv_cache_memory=8 * GiB)
    step_ms, graph_ms, kv_bytes = batch1_decode(llm, loaded.model)
    weights = _param_bytes(loaded.model)
    roof_ms = (weights + kv_bytes) / (hbm * 1e9) * 1e3
    return {"shape": name, "weight_GB": round(weights / 1e9, 2), "kv_read_MB": round(kv_bytes / 1e6, 1),
            "roofline_ms": round(roof_ms, 3), "graph_ms": round(graph_ms, 3),
            "engine_step_ms": round(step_ms, 3), "graph_over_roofline": round(graph_ms / roof_ms, 2),
            "step_over_roofline": round(step_ms / roof_ms, 2)}


def section_roofline(res: dict, hbm: float) -> None:
    rows = []
    for name in ("gemma3-1b", "gemma3-4b", "gemma3-27b"):
        rows.append(_roofline_row(name, hbm))
        print("roofline", rows[-1], flush=True)
        release_device_memory()
    res["roofline"] = rows


def section_throughput(res: dict) -> None:
    from gemmaserve.testing.hf_reference import build_hf_model

    loaded = random_model("gemma3-4b", torch.bfloat16, torch.device("cuda"))
    vocab = loaded.model.config.vocab_size
    rows = []
    llm = _engine(loaded, kv_cache_memory=48 * GiB, max_num_seqs=256)
    for batch in (64, 256):
        # Warm-up at the same shapes (other prompts): Triton compiles a kernel variant on first use, and
        # a fresh machine has no kernel cache.
        _run_all(llm, _prompts(batch, 1024, vocab, seed=batch + 1), 8)
        secs = _run_all(llm, _prompts(batch, 1024, vocab, seed=batch), 128)
        rows.append({"batch": batch, "ours_tok_s": round(batch * 128 / secs, 1), "ours_s": round(secs, 2)})
        print("throughput ours", rows[-1], flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    hf = build_hf_model(loaded.model, dtype=torch.bfloat16, device="cuda")
    for row in rows:
        batch = row["batch"]
        ids = torch.tensor(_prompts(batch, 1024, vocab, seed=batch), device="cuda")
        hf.generate(ids[:2, :64], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        fits = True
        try:
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128,
                            do_sample=False, pad_token_id=0)
        except torch.OutOfMemoryError:   # its KV cache (~41 GB at 256 x 1152 tokens) and more, on an 80 GB card
            fits = False
        if not fits:   # (outside the handler: its traceback held generate's tensors)
            card = torch.cuda.get_device_properties(0).total_memory / GiB
            row["hf"] = f"out of memory on this card ({card:.0f} GiB)"
            print("throughput hf", row, flush=True)
            del ids
            release_device_memory()
            continue
        torch.cuda.synchronize()
        secs = time.perf_counter() - start
        row.update(hf_tok_s=round(batch * 128 / secs, 1), hf_s=round(secs, 2),
                   ratio=round(row["ours_tok_s"] / (batch * 128 / secs), 1))
        print("throughput hf", row, flush=True)
        del ids
        torch.cuda.empty_cache()
    res["throughput"] = rows
    del hf, loaded
    gc.collect()
    torch.cuda.empty_cache()


def section_prefill(res: dict) -> None:
    loaded = random_model("gemma3-4b", torch.bfloat16, torch.device("cuda"))
    llm = _engine(loaded, kv_cache_memory=16 * GiB, max_num_batched_tokens=8192, enable_prefix_caching=False)
    vocab = loaded.model.config.vocab_size
    _run_all(llm, _prompts(1, 8192, vocab, seed=1), 1)   # warm-up
    times = [_run_all(llm, _prompts(1, 8192, vocab, seed=2 + i), 1) for i in range(3)]
    secs = sorted(times)[1]
    flops = 2 * sum(p.numel() for n, p in loaded.model.named_parameters() if "embed" not in n) * 8192
    res["prefill"] = {"shape": "gemma3-4b", "tokens": 8192, "seconds": round(secs, 3),
                      "tok_s": round(8192 / secs), "matmul_TFLOP_s": round(flops / secs / 1e12, 1)}
    print("prefill", res["prefill"], flush=True)
    del llm, loaded
    gc.collect()
    torch.cuda.empty_cache()


def section_pressure(res: dict) -> None:
    loaded = random_model("gemma3-4b", torch.bfloat16, torch.device("cuda"))
    vocab = loaded.model.config.vocab_size
    rng = random.Random(4)
    prompts = [_prompts(1, rng.randrange(8192, 32768), vocab, seed=100 + i)[0] for i in range(16)]
    rows = []
    for name, opts in (("v1", dict(kv_cache_manager="v1")),
                       ("v2", dict(kv_cache_manager="v2", swa_scratch_reuse="off")),
                       ("v2+scratch", dict(kv_cache_manager="v2", swa_scratch_reuse="on"))):
        llm = _engine(loaded, kv_cache_memory=6 * GiB, enable_prefix_caching=False, max_num_batched_tokens=8192,
                      **opts)
        _run_all(llm, _prompts(1, 512, vocab, seed=3), 4)   # warm-up
        pre = llm.engine.snapshot().preemptions
        secs = _run_all(llm, prompts, 64)
        rows.append({"kv": name, "seconds": round(secs, 2), "out_tok_s": round(16 * 64 / secs, 1),
                     "total_tok_s": round((sum(map(len, prompts)) + 16 * 64) / secs),
                     "preemptions": llm.engine.snapshot().preemptions - pre})
        print("pressure", rows[-1], flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    res["pressure"] = {"shape": "gemma3-4b", "kv_cache_GiB": 6, "prompts": len(prompts),
                       "prompt_tokens": sum(map(len, prompts)), "new_tokens": 64, "rows": rows}


def section_profile(res: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    from gemmaserve.engine.sampling_params import SamplingParams

    out = {}
    for name in ("gemma3-1b", "gemma3-4b"):
        loaded = random_model(name, torch.bfloat16, torch.device("cuda"))
        llm = _engine(loaded, kv_cache_memory=8 * GiB, enforce_eager=True)
        eng = llm.engine
        eng.add_request("", SamplingParams(max_tokens=64, ignore_eos=True),
                        prompt_ids=_prompts(1, 1024, loaded.model.config.vocab_size)[0])
        for _ in range(8):
            eng.step()
        torch.cuda.synchronize()
        steps = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
        kernels = [(e.key, e.device_time_total / steps / 1e3, e.count // steps) for e in prof.key_averages()
                   if e.device_time_total > 0]
        kernels.sort(key=lambda k: -k[1])
        total = sum(k[1] for k in kernels)
        out[name] = {"gpu_ms_per_step": round(total, 3),
                     "top": [{"kernel": k[0][:90], "ms": round(k[1], 4), "calls": k[2]} for k in kernels[:14]]}
        print("profile", name, json.dumps(out[name], indent=1), flush=True)
        while eng.has_unfinished_requests():
            eng.step()
        del llm, eng, loaded
        gc.collect()
        torch.cuda.empty_cache()
    out["gemma3-4b_batch64"] = _host_overhead(64)
    res["profile"] = out


def _host_overhead(batch: int) -> dict:
    """Decode at `batch` (prompt 1024) with graphs: engine step time against graph replay alone, and
    the host functions that take the difference."""
    import cProfile
    import io
    import pstats

    from gemmaserve.engine.sampling_params import SamplingParams

    loaded = random_model("gemma3-4b", torch.bfloat16, torch.device("cuda"))
    llm = _engine(loaded, kv_cache_memory=24 * GiB)
    eng = llm.engine
    parts = eng.internals()
    for p in _prompts(batch, 1024, loaded.model.config.vocab_size, seed=5):
        eng.add_request("", SamplingParams(max_tokens=200, ignore_eos=True), prompt_ids=p)
    while parts.scheduler.waiting or not all(r.prompt_computed for r in parts.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        eng.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / 50 * 1e3
    graph = parts.runner.graphs.graph(batch)
    replay = replay_ms(graph, 50)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        eng.step()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    print(text.getvalue(), flush=True)
    row = {"batch": batch, "engine_step_ms": round(step_ms, 3), "graph_ms": round(replay, 3)}
    print("host overhead", row, flush=True)
    for r in list(parts.scheduler.running):
        eng.abort_request(r.group_id)
    del llm, eng, parts, loaded
    gc.collect()
    torch.cuda.empty_cache()
    return row


def _decode_rows(eng, prompts: list[list[int]], steps: int = 50):
    """Fill the batch, then time decode steps (whole engine step) and the graph replay alone; also
    the host time of scheduling and launching (what async scheduling hides behind the device)."""
    from gemmaserve.engine.sampling_params import SamplingParams

    ids = [eng.add_request("", SamplingParams(max_tokens=10_000, ignore_eos=True), prompt_ids=p) for p in prompts]
    parts = eng.internals()
    sched, runner = parts.scheduler, parts.runner
    while sched.waiting or not all(r.prompt_computed for r in sched.running):
        eng.step()
    for _ in range(5):
        eng.step()
    host = [0.0]
    schedule, launch = sched.schedule, runner.launch

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                host[0] += time.perf_counter() - t
        return wrapper

    sched.schedule, runner.launch = timed(schedule), timed(launch)
    step_ms = engine_step_ms(eng, steps)
    sched.schedule, runner.launch = schedule, launch
    sizes = runner.graphs.sizes
    graph = runner.graphs.graph(sizes[bisect.bisect_left(sizes, len(prompts))])
    replay = replay_ms(graph, steps)
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return step_ms, replay, host[0] / steps * 1e3


def section_engine(res: dict, hbm: float) -> None:
    out = res["engine"] = {"decode": [], "throughput": [], "host_vs_context": []}
    for name in ("gemma3-1b", "gemma3-4b"):
        loaded = random_model(name, torch.bfloat16, torch.device("cuda"))
        vocab = loaded.model.config.vocab_size
        for mode in ("off", "on"):
            llm = _engine(loaded, kv_cache_memory=32 * GiB, max_num_seqs=256, async_scheduling=mode)
            for batch in (1, 64):
                step_ms, graph_ms, host_ms = _decode_rows(llm.engine, _prompts(batch, 1024, vocab, seed=batch))
                row = {"shape": name, "async": mode, "batch": batch, "engine_step_ms": round(step_ms, 3),
                       "graph_ms": round(graph_ms, 3), "step_over_graph": round(step_ms / graph_ms, 3),
                       "host_ms": round(host_ms, 3)}
                if batch == 1:
                    ctx = 1024 + 60
                    kv = sum(sp.bytes_per_token() * (min(ctx, sp.window) if sp.window else ctx)
                             for sp in loaded.model.kv_layer_specs(torch.bfloat16))
                    roof = (_param_bytes(loaded.model) + kv) / (hbm * 1e9) * 1e3
                    row.update(roofline_ms=round(roof, 3), step_over_roofline=round(step_ms / roof, 2))
                out["decode"].append(row)
                print("engine decode", row, flush=True)
            if name == "gemma3-4b":
                for batch in (64, 256):
                    # Seeds no other run here uses: a prompt seen before would be a prefix-cache hit.
                    _run_all(llm, _prompts(batch, 1024, vocab, seed=5000 + batch), 8)   # compile these shapes
                    secs = _run_all(llm, _prompts(batch, 1024, vocab, seed=6000 + batch), 128)
                    row = {"async": mode, "batch": batch, "tok_s": round(batch * 128 / secs, 1), "s": round(secs, 2)}
                    out["throughput"].append(row)
                    print("engine throughput", row, flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        if name == "gemma3-4b":
            llm = _engine(loaded, kv_cache_memory=48 * GiB, max_num_seqs=64)
            for ctx in (1024, 16384):
                step_ms, graph_ms, host_ms = _decode_rows(llm.engine, _prompts(64, ctx, vocab, seed=ctx), steps=30)
                row = {"batch": 64, "context": ctx, "engine_step_ms": round(step_ms, 3),
                       "graph_ms": round(graph_ms, 3), "host_ms": round(host_ms, 3)}
                out["host_vs_context"].append(row)
                print("engine host", row, flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        del loaded
        gc.collect()
        torch.cuda.empty_cache()


def section_invariant(res: dict, hbm: float, key: str, shapes: tuple[str, ...]) -> None:
    """`--batch-invariant` off and on, same weights, same run. Raises (the section's error, exit 1) when
    the invariant engine's probe is not bitwise the same alone, duplicated and in a mixed batch."""
    from gemmaserve.testing.invariance import probe_checks

    out = res[key] = {"decode": [], "prefill": [], "throughput": [], "check": []}
    failures = []
    for name in shapes:
        loaded = random_model(name, torch.bfloat16, torch.device("cuda"))
        vocab = loaded.model.config.vocab_size
        weights = _param_bytes(loaded.model)
        kv_mem = (16 if weights > 30e9 else 32) * GiB
        for mode in (False, True):
            llm = _engine(loaded, kv_cache_memory=kv_mem, max_num_seqs=64, batch_invariant=mode)
            eng = llm.engine
            assert eng.info.batch_invariant == mode
            for batch, ctx in ((1, 1024), (64, 1024), (1, 16384), (8, 16384)):
                step_ms, graph_ms, host_ms = _decode_rows(eng, _prompts(batch, ctx, vocab, seed=ctx + batch), steps=30)
                row = {"shape": name, "batch_invariant": mode, "batch": batch, "context": ctx,
                       "engine_step_ms": round(step_ms, 3), "graph_ms": round(graph_ms, 3)}
                if batch == 1:
                    kv = sum(sp.bytes_per_token() * (min(ctx, sp.window) if sp.window else ctx)
                             for sp in loaded.model.kv_layer_specs(torch.bfloat16))
                    row["graph_over_roofline"] = round(graph_ms / ((weights + kv) / (hbm * 1e9) * 1e3), 2)
                out["decode"].append(row)
                print("invariant decode", row, flush=True)
            eng.reset_prefix_cache()
            _run_all(llm, _prompts(1, 8192, vocab, seed=11), 1)   # compile the prefill shapes
            times = sorted(_run_all(llm, _prompts(1, 8192, vocab, seed=12 + i), 1) for i in range(3))
            row = {"shape": name, "batch_invariant": mode, "tokens": 8192, "tok_s": round(8192 / times[1])}
            out["prefill"].append(row)
            print("invariant prefill", row, flush=True)
            _run_all(llm, _prompts(64, 1024, vocab, seed=6999), 4)   # these shapes once before timing
            secs = _run_all(llm, _prompts(64, 1024, vocab, seed=7000), 128)
            row = {"shape": name, "batch_invariant": mode, "batch": 64, "tok_s": round(64 * 128 / secs, 1)}
            out["throughput"].append(row)
            print("invariant throughput", row, flush=True)
            eng.reset_prefix_cache()
            got = probe_checks(eng, _prompts(1, 1024, vocab, seed=8000)[0],
                               [_prompts(1, 4096, vocab, seed=8001)[0]] + _prompts(62, 300, vocab, seed=8002),
                               max_tokens=32)
            got.pop("alone")
            row = {"shape": name, "batch_invariant": mode, **got}
            out["check"].append(row)
            print("invariant check", row, flush=True)
            if mode and not (got["duplicate_equal"] and got["mixed_equal"]):
                failures.append(name)
            del llm, eng
            gc.collect()
            torch.cuda.empty_cache()
        del loaded
        gc.collect()
        torch.cuda.empty_cache()
    for kind in ("decode", "prefill", "throughput"):   # on / off, same shape and size
        rows = out[kind]
        for on in [r for r in rows if r["batch_invariant"]]:
            off = next(r for r in rows if not r["batch_invariant"]
                       and all(r.get(k) == on.get(k) for k in ("shape", "batch", "context", "tokens")))
            key = "graph_ms" if kind == "decode" else "tok_s"
            on["on_over_off"] = round(on[key] / off[key], 3)
    if failures:
        raise AssertionError(f"--batch-invariant gave a probe other bits in another batch: {', '.join(failures)}")


def compiled_variants() -> dict[str, int]:
    """Kernel variants Triton has compiled in this process, per kernel of ours."""
    import triton

    from gemmaserve.attention import triton_kernels
    from gemmaserve.models import fused_kernels

    out = {}
    for mod in (triton_kernels, fused_kernels):
        for name, fn in vars(mod).items():
            caches = getattr(fn, "device_caches", None)
            if isinstance(fn, triton.runtime.JITFunction) and caches:
                out[name] = sum(len(entry[0]) for entry in caches.values())
    return out


def section_first_request(res: dict) -> None:
    """Run first in a fresh process on a fresh machine (no Triton cache on disk): the engine's startup
    warm-up should leave the first long prompt no slower than the second, and compile nothing new."""
    loaded = random_model("gemma3-4b", torch.bfloat16, torch.device("cuda"))
    vocab = loaded.model.config.vocab_size
    llm = _engine(loaded, kv_cache_memory=16 * GiB, max_num_seqs=8, max_num_batched_tokens=2048)
    variants = [compiled_variants()]
    times = []
    for i in range(3):
        times.append(_run_all(llm, _prompts(1, 32768, vocab, seed=70 + i), 4))
        variants.append(compiled_variants())
    new = {k: v - variants[0].get(k, 0) for k, v in variants[1].items() if v != variants[0].get(k, 0)}
    res["first_request"] = {"shape": "gemma3-4b", "prompt": 32768, "new_tokens": 4,
                            "warmup_s": llm.engine.info.warmup_seconds, "runs_s": [round(t, 3) for t in times],
                            "first_over_second": round(times[0] / times[1], 3),
                            "variants_after_warmup": variants[0], "compiled_in_first_request": new,
                            "compiled_later": variants[-1] != variants[1]}
    print("engine first request", res["first_request"], flush=True)


def main(argv: list[str]) -> int:
    sections = argv or ["roofline", "attention", "prefill", "throughput", "pressure"]
    out = Path(os.environ.get("OUT", "bench-out")) / "gpu_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    hbm = copy_bandwidth()
    res["hbm_copy_GB_s"] = round(hbm)
    print("HBM copy", res["hbm_copy_GB_s"], "GB/s", flush=True)
    run_sections(res, sections, {
        "roofline": lambda: section_roofline(res, hbm),
        "attention": lambda: res.__setitem__("attention", decode_bandwidth(hbm)),
        "prefill": lambda: section_prefill(res),
        "throughput": lambda: section_throughput(res),
        "pressure": lambda: section_pressure(res),
        "profile": lambda: section_profile(res),
        "engine": lambda: section_engine(res, hbm),
        "first": lambda: section_first_request(res),
        "invariant": lambda: section_invariant(res, hbm, "invariant", ("gemma3-4b",)),
        "invariant-moe": lambda: section_invariant(res, hbm, "invariant-moe", ("gemma4-26b-a4b",)),
    }, out)
    print(json.dumps(res, indent=1))
    return exit_status(res, CHECKS)


# Every section here measures (no check rows): the exit status is 1 only if a section raised (the
# batch-invariance sections raise when their check fails).
CHECKS: dict = {}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
