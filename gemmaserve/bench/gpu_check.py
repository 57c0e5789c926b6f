"""GPU correctness checks and kernel timings, in one run (`python -m gemmaserve.bench.gpu_check`).

1. HBM copy bandwidth (read + write bytes over time), the ceiling for memory-bound kernels.
2. Triton kernels against a float64 reference on fresh random inputs: decode (split-K) and prefill
   over paged KV, head dims 128/256/512, GQA, full and sliding windows, bf16 and fp32.
3. Decode attention bandwidth at contexts 4K..128K (bytes of K/V read over time).
4. The engine on a tiny random Gemma 3: greedy tokens with the torch and Triton backends, and with
   CUDA graphs on and off, must match.
Prints a table last; writes JSON to $OUT (or bench-out/) as gpu_check.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from .sections import exit_status


def _bench_ms(fn, reps: int = 20) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=reps * 10, return_mode="median")


def copy_bandwidth() -> float:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    ms = _bench_ms(lambda: b.copy_(a))
    return 2 * n / (ms * 1e-3) / 1e9   # GB/s, read + write


def _paged(gen, lens, hkv, d, t, dtype):
    blocks = [-(-n // t) for n in lens]
    num_pages = sum(blocks) + 3
    perm = torch.randperm(num_pages, generator=gen)
    kc = torch.randn(num_pages, t, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(num_pages, t, hkv, d, generator=gen).to(dtype)
    pages = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    dk, dv, i = [], [], 0
    for b, nb in enumerate(blocks):
        pages[b, :nb] = perm[i:i + nb].int()
        i += nb
        dk.append(kc[pages[b, :nb].long()].reshape(-1, hkv, d)[:lens[b]])
        dv.append(vc[pages[b, :nb].long()].reshape(-1, hkv, d)[:lens[b]])
    return kc.cuda(), vc.cuda(), pages.cuda(), dk, dv


def _dense(q, k, v, q_pos, window, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    s = torch.einsum("nhd,lhd->hnl", q.double().cpu(), k) * scale
    diff = q_pos[:, None] - torch.arange(k.shape[0])[None, :]
    vis = (diff >= 0) & ((diff < window) if window else True)
    s = s.masked_fill(~vis[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def kernel_checks() -> list[dict]:
    from ..attention import triton_kernels as K

    rows = []
    gen = torch.Generator().manual_seed(int(time.time()))
    cases = [(128, 32, 16, None), (128, 32, 16, 1024), (256, 8, 4, 1024), (256, 4, 1, 512), (512, 32, 4, None),
             (256, 16, 8, None)]
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        for d, hq, hkv, window in cases:
            lens, t = [3000, 17, 1500], 16
            kc, vc, pages, dk, dv = _paged(gen, lens, hkv, d, t, dtype)
            first = torch.zeros(len(lens), dtype=torch.int32, device="cuda")
            q = torch.randn(len(lens), hq, d, generator=gen).to(dtype).cuda()
            out = K.decode_attention(q, kc, vc, pages, first, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                     d ** -0.5, window, K.decode_splits(len(lens), hkv, max(lens)))
            err = max(((out[b:b + 1].double().cpu() - _dense(q[b:b + 1], dk[b], dv[b], torch.tensor([n - 1]), window,
                                                              d ** -0.5)).norm()
                       / _dense(q[b:b + 1], dk[b], dv[b], torch.tensor([n - 1]), window, d ** -0.5).norm()).item()
                      for b, n in enumerate(lens))
            rows.append({"kernel": "decode", "dtype": str(dtype)[6:], "d": d, "hq": hq, "hkv": hkv, "window": window,
                         "rel_err": err, "ok": err < tol})
            q_lens = [700, 17, 1]
            qq = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype).cuda()
            starts = torch.tensor([0, 700, 717], dtype=torch.int32, device="cuda")
            seqs, tiles = K.prefill_tiles(q_lens, K.prefill_block_m(d))
            out = K.prefill_attention(qq, kc, vc, pages, first, starts, torch.tensor(q_lens, dtype=torch.int32, device="cuda"),
                                      torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                      torch.tensor(seqs, dtype=torch.int32, device="cuda"),
                                      torch.tensor(tiles, dtype=torch.int32, device="cuda"), d ** -0.5, window)
            errs = []
            for b, (n, m) in enumerate(zip(lens, q_lens)):
                r = slice(int(starts[b]), int(starts[b]) + m)
                ref = _dense(qq[r], dk[b], dv[b], torch.arange(n - m, n), window, d ** -0.5)
                errs.append(((out[r].double().cpu() - ref).norm() / ref.norm()).item())
            rows.append({"kernel": "prefill", "dtype": str(dtype)[6:], "d": d, "hq": hq, "hkv": hkv, "window": window,
                         "rel_err": max(errs), "ok": max(errs) < tol})
    return rows


def decode_bandwidth(hbm: float) -> list[dict]:
    """Gemma 3 4B global-layer shape: 8 query heads, 4 KV heads x 256, bf16, one layer."""
    from ..attention import triton_kernels as K

    rows = []
    hq, hkv, d, t = 8, 4, 256, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for ctx, bsz in [(c, min(64, max(1, (8 << 30) // (c * hkv * d * 2 * 2)))) for c in (4096, 16384, 32768, 65536, 131072)] \
            + [(c, 1) for c in (4096, 32768, 131072)]:   # ~8 GiB of KV (far beyond L2), then one sequence
        blocks = ctx // t
        num_pages = bsz * blocks
        kc = torch.randn(num_pages, t, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        pages = torch.randperm(num_pages, device="cuda", dtype=torch.int64).int().view(bsz, blocks)
        q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((bsz,), ctx, dtype=torch.int32, device="cuda")
        first = torch.zeros(bsz, dtype=torch.int32, device="cuda")
        splits = K.decode_splits(bsz, hkv, ctx, sms)
        out = torch.empty_like(q)

        def call():
            K.decode_attention(q, kc, vc, pages, first, lens, 0.0625, None, splits, out=out)

        call()   # compile, then time a captured graph: at batch 1 a Python launch outlasts the kernels
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        ms = _bench_ms(graph.replay)
        nbytes = 2 * bsz * ctx * hkv * d * 2
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append({"context": ctx, "batch": bsz, "ms": round(ms, 3), "GB_s": round(gbs), "of_hbm": round(gbs / hbm, 3)})
        kc = vc = graph = None   # free before the next size
        torch.cuda.empty_cache()
    return rows


def engine_checks() -> list[dict]:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from helpers import save_checkpoint, tiny_hf_model

    from ..config.engine import EngineConfig
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams

    rows = []
    path = save_checkpoint(tiny_hf_model(int(time.time()) % 10000, sliding_window=8, num_key_value_heads=2,
                                         head_dim=128, num_attention_heads=4, hidden_size=256),
                           Path(tempfile.mkdtemp()) / "tiny")
    # the last prompt is over 256 tokens: the torch backend's prefill runs in query blocks (torch_backend.py)
    prompts = ["abcdefghij klmnop qrstuv " * 8, "zyxw vuts " * 3, "hello", "one two three four five six " * 20]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    base = LLM(model=str(path), device="cuda", dtype="float32", attention_backend="torch", kv_cache_manager="v1",
               page_size=16, kv_cache_memory=1 << 30, async_scheduling="off")
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    # Seeded sampling with penalties and logprobs: asynchronous scheduling (the CUDA default) must
    # draw exactly what the synchronous engine draws.
    sampling = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=s,
                               repetition_penalty=1.2, logprobs=2) for s in range(len(prompts))]
    drawn = {}
    for mode in ("off", "on"):
        llm = LLM.from_config(EngineConfig(model=str(path), device="cuda", dtype="float32", page_size=16,
                                           kv_cache_memory=1 << 30, async_scheduling=mode), base)
        drawn[mode] = [(o.outputs[0].token_ids, [lp.token_id for lp in o.outputs[0].logprobs])
                       for o in llm.generate(prompts, sampling, use_tqdm=False)]
    rows.append({"engine": "triton graphs sampled async vs sync", "tokens_equal": drawn["on"] == drawn["off"],
                 "cuda_graphs": True})
    for name, opts in (("triton graphs v2+scratch fp32", dict(attention_backend="triton")),
                       ("triton graphs sync fp32", dict(attention_backend="triton", async_scheduling="off")),
                       ("triton eager v2+scratch fp32", dict(attention_backend="triton", enforce_eager=True)),
                       ("triton graphs chunk 16 fp32", dict(attention_backend="triton", max_num_batched_tokens=16)),
                       ("torch v2+scratch fp32", dict(attention_backend="torch"))):
        llm = LLM.from_config(EngineConfig(model=str(path), device="cuda", dtype="float32", page_size=16,
                                           kv_cache_memory=1 << 30, **opts), base)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        rows.append({"engine": name, "tokens_equal": got == ref, "cuda_graphs": llm.engine.info.cuda_graphs})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["engine"]:   # just the engine checks
        rows = engine_checks()
        for r in rows:
            print(f"  engine {r['engine']:<30} graphs={r['cuda_graphs']} tokens equal: {r['tokens_equal']}")
        return exit_status({"engine": rows}, CHECKS)
    out_dir = Path(os.environ.get("OUT", "bench-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    result["triton"] = triton.__version__
    hbm = copy_bandwidth()
    result["hbm_copy_GB_s"] = round(hbm)
    result["kernels"] = kernel_checks()
    result["decode_bandwidth"] = decode_bandwidth(hbm)
    result["engine"] = engine_checks()
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"{result['device']}  torch {result['torch']}  triton {result['triton']}  HBM copy {result['hbm_copy_GB_s']} GB/s")
    for r in result["kernels"]:
        print(f"  {r['kernel']:<8} {r['dtype']:<9} d={r['d']:<4} hq={r['hq']:<3} hkv={r['hkv']:<3} "
              f"window={str(r['window']):<5} rel_err={r['rel_err']:.2e} {'ok' if r['ok'] else 'FAIL'}")
    for r in result["decode_bandwidth"]:
        print(f"  decode attention ctx={r['context']:>6} batch={r['batch']:>3} {r['ms']:>8} ms "
              f"{r['GB_s']:>6} GB/s = {r['of_hbm']:.0%} of HBM")
    for r in result["engine"]:
        print(f"  engine {r['engine']:<28} tokens equal: {r['tokens_equal']}")
    return exit_status(result, CHECKS)


# Rows that pass or fail (bench/sections.py): the exit status is 1 if one fails.
CHECKS = {"kernels": lambda r: r["ok"], "engine": lambda r: r["tokens_equal"]}


if __name__ == "__main__":
    sys.exit(main())
