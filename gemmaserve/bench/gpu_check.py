"""GPU correctness checks and kernel timings, in one run (`python -m gemmaserve.bench.gpu_check`).

1. HBM copy bandwidth (read + write bytes over time), the ceiling for memory-bound kernels.
2. Triton kernels against a float64 reference on fresh random inputs: decode (split-K) and prefill
   over paged KV, head dims 128/256/512, GQA, full and sliding windows, bf16 and fp32.
3. Decode attention bandwidth at contexts 4K..128K (bytes of K/V read over time).
4. The engine on a tiny random Gemma 3: greedy tokens with the torch and Triton backends, and with
   CUDA graphs on and off, must match.
5. `--batch-invariant` (`invariance_checks`, alone: `gpu_check invariance`): the invariant GEMM's rows
   (bf16, real widths, M = 1..2048, any row position) and its grouped form (128 experts), the attention
   of one query alone, in a batch and inside prefill chunks of any split, all bitwise equal; and a tiny
   Gemma 3 engine whose probe prompt's logits are bitwise the same alone, duplicated, in a mixed chunked
   batch and with CUDA graphs on or off.
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


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                              b.contiguous().view(-1).view(torch.uint8))


def invariance_checks() -> list[dict]:
    """`--batch-invariant` on the GPU: each row is {"check", "ok", ...}."""
    import tempfile

    from ..attention import triton_kernels as K
    from ..models import invariant_kernels as IK

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(int(time.time()))
    dt = torch.bfloat16
    # GEMM rows: gemma3-4b widths (qkv, down, gate_up: wide tiles, the output head).
    for n, k, ms in ((4096, 2560, (1, 3, 8, 17, 64, 257, 2048)), (2560, 10240, (1, 3, 8, 17, 64, 257, 2048)),
                     (20480, 2560, (1, 3, 8, 17, 64, 257, 2048)), (262208, 2560, (1, 3, 8, 17, 64, 256))):
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(dt)
        pool = torch.randn(max(ms), k, device="cuda", generator=gen).to(dt)
        probe = pool[-1].clone()
        ref = IK.matmul(probe[None], w)[0]
        err = ((ref.float() - (probe.float() @ w.float().T)).norm() / (probe.float() @ w.float().T).norm()).item()
        same = True
        for m in ms:
            for pos in sorted({0, m // 2, m - 1}):
                x = pool[:m].clone()
                x[pos] = probe
                same &= _bits_equal(IK.matmul(x, w)[pos], ref)
        rows.append({"check": f"gemm N={n} K={k}", "ok": same and err < 1e-2, "rows_equal": same, "rel_err": err})
        del w, pool
    # Grouped GEMM (26B-A4B experts' gate_up): one row of expert 5 among ever other rows per expert.
    e, k, n = 128, 2816, 1408
    w = (torch.randn(e, n, k, device="cuda", generator=gen) * k ** -0.5).to(dt).transpose(1, 2)
    probe = torch.randn(k, device="cuda", generator=gen).to(dt)
    ref, same = None, True
    for total in (1, 8, 64, 512, 4096):
        counts = torch.multinomial(torch.ones(e, device="cuda"), total, replacement=True, generator=gen).bincount(
            minlength=e)
        counts[5] += 1
        ends = counts.cumsum(0).to(torch.int32)
        x = torch.randn(int(ends[-1]), k, device="cuda", generator=gen).to(dt)
        at = int(ends[4]) + int(torch.randint(0, int(counts[5]), (1,), device="cuda", generator=gen))
        x[at] = probe
        y = IK.grouped_matmul(x, w, ends)[at]
        ref = y if ref is None else ref
        same &= _bits_equal(y, ref)
    expect = probe.float() @ w[5].float()
    err = ((ref.float() - expect).norm() / expect.norm()).item()
    rows.append({"check": f"grouped gemm E={e} N={n} K={k}", "ok": same and err < 1e-2, "rows_equal": same,
                 "rel_err": err})
    del w
    # Attention: one query alone, in a batch, and inside prefill chunks of several splits.
    for d, hq, hkv, window in ((128, 32, 16, None), (256, 8, 4, 1024), (512, 16, 2, None)):
        lens, t = [3000, 700, 1500], 16
        kc, vc, pages, _, _ = _paged(torch.Generator().manual_seed(d), lens, hkv, d, t, dt)
        n = lens[0]
        qs = torch.randn(n, hq, d, device="cuda", generator=gen).to(dt)
        z = lambda b: torch.zeros(b, dtype=torch.int32, device="cuda")   # noqa: E731
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")   # noqa: E731

        def one_token(q, pg, seq_lens):
            b = q.shape[0]
            iota = torch.arange(b, dtype=torch.int32, device="cuda")
            return K.prefill_attention(q, kc, vc, pg, z(b), iota, iota * 0 + 1, seq_lens, iota, z(b), d ** -0.5,
                                       window)

        pos = torch.arange(n - 200, n, device="cuda")
        decode = one_token(qs[pos], pages[[0] * 200], (pos + 1).int())
        mixed = one_token(torch.cat([qs[:1], qs[n - 1:], qs[:1]]), pages[[1, 0, 2]], i32([lens[1], n, lens[2]]))
        same = _bits_equal(mixed[1], decode[-1])
        for splits in ([200], [1, 199], [77, 100, 23]):
            start, got = n - 200, []
            for m in splits:
                q = torch.cat([qs[:5], qs[start:start + m]])
                seqs, tiles = K.prefill_tiles([5, m], K.prefill_block_m(d))
                out = K.prefill_attention(q, kc, vc, pages[[1, 0]], z(2), i32([0, 5]), i32([5, m]),
                                          i32([lens[1], start + m]), i32(seqs), i32(tiles), d ** -0.5, window)
                got.append(out[5:])
                start += m
            same &= _bits_equal(torch.cat(got), decode)
        rows.append({"check": f"attention d={d} hq={hq} hkv={hkv} window={window}", "ok": same, "rows_equal": same})
    # The engine: a tiny Gemma 3 in bf16.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from helpers import save_checkpoint, tiny_hf_model

    from ..config.engine import EngineConfig
    from ..engine.llm import LLM
    from ..testing.invariance import probe_checks, same_bits

    path = save_checkpoint(tiny_hf_model(int(time.time()) % 10000, sliding_window=64, num_key_value_heads=2,
                                         head_dim=128, num_attention_heads=4, hidden_size=256, vocab_size=4096),
                           Path(tempfile.mkdtemp()) / "tiny")
    vocab = 4096
    probe = [2] + [(7 * j) % (vocab - 5) + 5 for j in range(700)]
    others = [[2] + [(11 * j) % (vocab - 5) + 5 for j in range(1500)]] + [
        [2] + [(13 * j + i) % (vocab - 5) + 5 for j in range(20 + 37 * i)] for i in range(30)]
    base = dict(model=str(path), device="cuda", dtype="bfloat16", page_size=16, kv_cache_memory=1 << 30,
                max_num_batched_tokens=512)
    alone = {}
    for name, opts in (("graphs", {}), ("eager", dict(enforce_eager=True)), ("default", dict(batch_invariant=False))):
        llm = LLM.from_config(EngineConfig(**{"batch_invariant": True, **base, **opts}))
        got = probe_checks(llm.engine, probe, others, max_tokens=24)
        alone[name] = got.pop("alone")
        ok = got["duplicate_equal"] and got["mixed_equal"]
        rows.append({"check": f"engine {name}: alone = duplicated = in a mixed batch of 32", "ok": ok
                     if name != "default" else True, **got, "info_batch_invariant": llm.engine.info.batch_invariant})
        del llm
    rows.append({"check": "engine: graphs = eager", "ok": same_bits(alone["graphs"], alone["eager"])})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["engine"]:   # just the engine checks
        rows = engine_checks()
        for r in rows:
            print(f"  engine {r['engine']:<30} graphs={r['cuda_graphs']} tokens equal: {r['tokens_equal']}")
        return exit_status({"engine": rows}, CHECKS)
    if argv == ["invariance"]:   # just the --batch-invariant checks
        rows = invariance_checks()
        for r in rows:
            print(f"  {r['check']:<58} {'ok' if r['ok'] else 'FAIL'}  {r}")
        return exit_status({"invariance": rows}, CHECKS)
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
    result["invariance"] = invariance_checks()
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
    for r in result["invariance"]:
        print(f"  batch-invariant {r['check']:<58} {'ok' if r['ok'] else 'FAIL'}")
    return exit_status(result, CHECKS)


# Rows that pass or fail (bench/sections.py): the exit status is 1 if one fails.
CHECKS = {"kernels": lambda r: r["ok"], "engine": lambda r: r["tokens_equal"], "invariance": lambda r: r["ok"]}


if __name__ == "__main__":
    sys.exit(main())
