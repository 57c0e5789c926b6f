"""Products over quantised weights on the GPU (`python -m benchmarks.gpu_quant [sections]`), at the projection
shapes of Gemma 4 31B, 12B and E4B (sliding layers: fused qkv, o, fused gate_up, down), batch M = 1..64.
Sections (default: all; about 3 minutes on one H100, Triton compilation included):

  hbm     device-to-device copy bandwidth (read + write), the roofline the timings are read against
  check   each product on the device against its fp32 reference at every shape and M (bf16 activations):
          int4 (group 32 / 128, symmetric, group 128 asymmetric, and group 32 in the offset form with fp32
          scales and offsets, as GGUF's Q4_K loads) and int8 groups (int8_q8_0: group 32, fp16 scales, as GGUF's
          Q8_0 loads; int8_q6_k: q - 32 in groups of 16, fp32 scales, as Q6_K) against schemes' fp32
          dequantisation,
          fp8 per channel and in 128 x 128 blocks against the fp32 product of both operands quantised the
          same way; the relative error of the bf16 output, and bf16 F.linear's against fp32 for scale;
          each call repeated: the same bits every time (split-K sums its slices in a fixed order)
  timing  bf16 F.linear, int4_linear (g32, g128, g32 offset), int8_linear (int8_q8_0), fp8_linear (per channel,
          blocks), each call replayed in a CUDA graph (weights cycled over copies that exceed L2, so every call
          reads HBM): median microseconds per call, effective bandwidth (weight + scale bytes / time), fraction of
          the copy bandwidth, speedup over bf16
  sweep   int4 g32 GEMV tile configurations at M = 1 on the 31B and E4B shapes (what the heuristic could choose)
  tiled   the tiled int4 kernel's configurations at M = 16 and 64 on the 31B shapes (group 32)
  prefetch  the int4 GEMV at M = 1 with its next step's words loaded ahead, or Triton's pipelining, or neither
  pairs   the int4 pairs kernel (int4_pairs: two weights per PTX instruction) for M <= 16: checked, timed
          against bf16 and the tiled kernel, swept on the 31B's qkv
  pairs_candidates  the pairs kernel's configurations on every shape, each checked before it is timed against
          the path's (where `pairs_config`'s per-shape choice comes from)
  experts the grouped MoE expert products (int4, fp8) at the 26B-A4B's shapes: checked as `check` does, and timed
          against bf16 torch._grouped_mm

Writes $OUT/gpu_quant.json after every section; a table last. Exit status 1 if a check row fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from gemmaserve.bench.sections import exit_status, run_sections
from gemmaserve.quantization import fp8_kernels as F8
from gemmaserve.quantization import int4_kernels as I4
from gemmaserve.quantization import int8_kernels as I8
from gemmaserve.quantization.launch import split_k
from gemmaserve.quantization.schemes import FP8_DTYPE, Fp8Weight, Int4Weight, Int8Weight, quantize_fp8_per_channel

# (model, projection, N, K) for the sliding-window layers (5 of every 6), docs/gemma-architecture's table:
# qkv = heads * 256 + 2 * kv_heads * 256, o = hidden x heads * 256, gate_up = 2 * intermediate.
SHAPES = (
    ("gemma4-31b", "qkv", 32 * 256 + 2 * 16 * 256, 5376), ("gemma4-31b", "o", 5376, 32 * 256),
    ("gemma4-31b", "gate_up", 2 * 21504, 5376), ("gemma4-31b", "down", 5376, 21504),
    ("gemma4-12b", "qkv", 16 * 256 + 2 * 8 * 256, 3840), ("gemma4-12b", "o", 3840, 16 * 256),
    ("gemma4-12b", "gate_up", 2 * 15360, 3840), ("gemma4-12b", "down", 3840, 15360),
    ("gemma4-e4b", "qkv", 8 * 256 + 2 * 2 * 256, 2560), ("gemma4-e4b", "o", 2560, 8 * 256),
    ("gemma4-e4b", "gate_up", 2 * 10240, 2560), ("gemma4-e4b", "down", 2560, 10240),
)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
METHODS = ("bf16", "int4_g32", "int4_g128", "int4_g32_offset", "int8_q8_0", "fp8_channel", "fp8_block")
CHECK_TOL = 8e-3   # bf16 output rounding (~2e-3 relative) with margin; a wrong kernel is off by O(1)
L2_BYTES = 256 << 20   # cycle weight copies until a graph's calls read at least this much (H100 L2: 50 MB)


def _int4(gen: torch.Generator, n: int, k: int, group: int, asym: bool | str) -> Int4Weight:
    """`asym`: zero points; "offset": w = s q - o with fp32 s and o (GGUF Q4_K's form), o about 7.5 s."""
    q = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.uint8)
    if asym == "offset":
        scale = torch.rand(n, k // group, generator=gen, device="cuda") * 0.02 + 1e-3
        return Int4Weight(q, scale, None, group, scale * torch.rand(n, k // group, generator=gen, device="cuda") * 15)
    scale = (torch.rand(n, k // group, generator=gen, device="cuda") * 0.02 + 1e-3).to(torch.bfloat16)
    zero = torch.randint(0, 16, (n, k // group), generator=gen, device="cuda", dtype=torch.uint8) if asym else None
    return Int4Weight(q, scale, zero, group)


def _int8(gen: torch.Generator, n: int, k: int, group: int, scale_dtype: torch.dtype, levels: int) -> Int8Weight:
    """Values -levels..levels-1 (128: Q8_0's int8, 32: Q6_K's q - 32), one `scale_dtype` scale per group."""
    q = torch.randint(-levels, levels, (n, k), generator=gen, device="cuda", dtype=torch.int8)
    scale = (torch.rand(n, k // group, generator=gen, device="cuda") * 2e-3 + 1e-4).to(scale_dtype)
    return Int8Weight(q, scale, group)


def _fp8_block(gen: torch.Generator, n: int, k: int) -> Fp8Weight:
    q = (torch.randn(n, k, generator=gen, device="cuda") * 60).clamp(-448, 448).to(FP8_DTYPE)
    return Fp8Weight(q, torch.rand(-(-n // 128), -(-k // 128), generator=gen, device="cuda") * 1e-3 + 1e-4,
                     (128, 128))


@dataclasses.dataclass
class Method:
    """One product at one shape: its call, the bytes of weight it reads, and its fp32 reference."""
    call: Callable[[torch.Tensor, object], torch.Tensor]
    weight: object
    nbytes: int
    reference: Callable[[torch.Tensor], torch.Tensor]


def _methods(n: int, k: int, seed: int) -> dict[str, Method]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dense = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    out: dict[str, Method] = {}
    dense32 = dense.float()
    out["bf16"] = Method(lambda x, w: F.linear(x, w), dense, dense.numel() * 2, lambda x: F.linear(x.float(), dense32))
    for name, group, asym in (("int4_g32", 32, False), ("int4_g128", 128, False), ("int4_g128_asym", 128, True),
                              ("int4_g32_offset", 32, "offset")):
        w = _int4(gen, n, k, group, asym)
        ref = w.dequantize(torch.float32)
        out[name] = Method(I4.int4_linear, I4.pack_int4(w), I4.pack_int4(w).nbytes,
                           lambda x, ref=ref: F.linear(x.float(), ref))
        del w
    for name, group, scale_dtype, levels in (("int8_q8_0", 32, torch.float16, 128),
                                             ("int8_q6_k", 16, torch.float32, 32)):
        w8 = _int8(gen, n, k, group, scale_dtype, levels)
        ref = w8.dequantize(torch.float32)
        packed = I8.pack_int8(w8)
        out[name] = Method(I8.int8_linear, packed, packed.nbytes, lambda x, ref=ref: F.linear(x.float(), ref))
        del w8
    fc = quantize_fp8_per_channel(dense)
    out["fp8_channel"] = Method(F8.fp8_linear, fc, n * k + n * 4,
                                lambda x, w=fc: F8.fp8_linear_reference(x, w, torch.float32))
    fb = _fp8_block(gen, n, k)
    out["fp8_block"] = Method(F8.fp8_linear, fb, n * k + fb.scale.numel() * 4,
                              lambda x, w=fb: F8.fp8_linear_reference(x, w, torch.float32))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def section_check(res: dict) -> None:
    rows = res["check"] = []
    for i, (model, proj, n, k) in enumerate(SHAPES):
        methods = _methods(n, k, seed=i)
        gen = torch.Generator(device="cuda").manual_seed(1000 + i)
        row: dict = {"model": model, "proj": proj, "N": n, "K": k}
        for name, m in methods.items():
            worst, same_bits = 0.0, True
            for b in BATCHES:
                x = torch.randn(b, k, generator=gen, device="cuda", dtype=torch.bfloat16)
                y = m.call(x, m.weight)
                assert y.shape == (b, n) and y.dtype == torch.bfloat16, (name, y.shape, y.dtype)
                worst = max(worst, _rel(y, m.reference(x)))
                same_bits &= all(torch.equal(y, m.call(x, m.weight)) for _ in range(3))   # split-K's fixed order
            row[f"{name}_max_rel_err"] = float(f"{worst:.3g}")
            row[f"{name}_deterministic"] = same_bits
        rows.append(row)
        print("check", row, flush=True)
        del methods
        torch.cuda.empty_cache()


def check_row_ok(row: dict) -> bool:
    return all(v <= CHECK_TOL for key, v in row.items() if key.endswith("_max_rel_err")) and \
        all(v for key, v in row.items() if key.endswith("_deterministic"))


def _copies(w: object) -> object:
    """A fresh copy of a weight (every tensor cloned): a graph cycles over copies so that L2 holds none."""
    if isinstance(w, torch.Tensor):
        return w.clone()
    return dataclasses.replace(w, **{f.name: getattr(w, f.name).clone() for f in dataclasses.fields(w)
                                     if isinstance(getattr(w, f.name), torch.Tensor)})


def graph_us(call: Callable[[torch.Tensor, object], torch.Tensor], x: torch.Tensor, weights: list[object],
             reps: int = 15) -> float:
    """Median microseconds per call: one CUDA graph runs the call once per weight copy; replays timed apart."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):   # warm-up outside the graph (compiles, allocator pools)
        for w in weights[:2]:
            call(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(x, w)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3 / len(weights))
    del graph
    return statistics.median(times)


def section_timing(res: dict, hbm_gbs: float | None) -> None:
    rows = res["timing"] = []
    for i, (model, proj, n, k) in enumerate(SHAPES):
        methods = {name: m for name, m in _methods(n, k, seed=i).items() if name in METHODS}
        copies = {name: [m.weight] + [_copies(m.weight) for _ in range(max(0, -(-L2_BYTES // m.nbytes) - 1))]
                  for name, m in methods.items()}
        for b in BATCHES:
            x = torch.randn(b, k, device="cuda", dtype=torch.bfloat16)
            row: dict = {"model": model, "proj": proj, "N": n, "K": k, "M": b}
            for name, m in methods.items():
                us = graph_us(m.call, x, copies[name])
                gbs = m.nbytes / (us * 1e-6) / 1e9
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_GBs"] = round(gbs)
                if hbm_gbs:
                    row[f"{name}_of_copy_bw"] = round(gbs / hbm_gbs, 2)
            for name in methods:
                row[f"{name}_speedup"] = round(row["bf16_us"] / row[f"{name}_us"], 2)
            rows.append(row)
            print("timing", {key: v for key, v in row.items() if key.endswith(("_us", "M", "proj", "model"))},
                  flush=True)
        del methods, copies
        torch.cuda.empty_cache()


def section_sweep(res: dict) -> None:
    """The int4 GEMV kernel (group 32, Google's QAT) at M = 1 on the 31B and E4B shapes under a grid of tiles
    (block_n, block_k, waves of programs via k_per_split, warps, stages), against the heuristic's choice."""
    rows = res["sweep"] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i, (model, proj, n, k) in enumerate(SHAPES[:4] + SHAPES[8:]):
        gen = torch.Generator(device="cuda").manual_seed(i)
        packed = I4.pack_int4(_int4(gen, n, k, 32, False))
        weights = [packed] + [_copies(packed) for _ in range(max(0, -(-L2_BYTES // packed.nbytes) - 1))]
        for m in ((1, 4) if model == "gemma4-31b" else (1,)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            auto = I4.int4_config(m, n, k, 32, sms)
            row: dict = {"model": model, "proj": proj, "N": n, "K": k, "M": m, "auto": dataclasses.astuple(auto)}
            row["auto_us"] = round(graph_us(I4.int4_linear, x, weights), 2)
            for bn in ((64, 128, 256) if m == 1 else (64, 128)):
                for bk in ((128, 256, 512) if m == 1 else (64, 128)):
                    for waves in (1, 2, 4):
                        tiles = -(-n // bn)
                        per = max(bk, -(-k // max(1, -(-waves * sms // tiles)) // bk) * bk)
                        for warps, stages in ((4, 1), (8, 1)):
                            cfg = I4.Int4Config(triton.next_power_of_2(m), bn, bk, per, warps, stages, gemv=True)
                            try:
                                us = graph_us(lambda x_, w_, cfg=cfg: I4.int4_linear(x_, w_, cfg), x, weights, reps=7)
                            except Exception as exc:   # a config that does not compile (registers): skip
                                row[str(dataclasses.astuple(cfg))] = repr(exc)[:80]
                                continue
                            row[str(dataclasses.astuple(cfg))] = round(us, 2)
            best = min((v, key) for key, v in row.items() if key.startswith("(") and isinstance(v, float))
            row["best"], row["best_us"] = best[1], best[0]
            row["auto_GBs"] = round(packed.nbytes / (row["auto_us"] * 1e-6) / 1e9)
            row["best_GBs"] = round(packed.nbytes / (best[0] * 1e-6) / 1e9)
            rows.append(row)
            print("sweep", {key: row[key] for key in ("model", "proj", "M", "auto", "auto_us", "best", "best_us",
                                                      "best_GBs")}, flush=True)
        del weights, packed
        torch.cuda.empty_cache()


def section_prefetch(res: dict) -> None:
    """The int4 GEMV (group 32, M = 1) with the next step's words loaded ahead (`prefetch`) or Triton's own
    pipelining (num_stages 2) against neither, over column tiles, steps and warps, on the 31B and E4B shapes
    (K slices as the heuristic cuts them: about four waves)."""
    rows = res["prefetch"] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i, (model, proj, n, k) in enumerate(SHAPES[:4] + SHAPES[8:]):
        gen = torch.Generator(device="cuda").manual_seed(i)
        packed = I4.pack_int4(_int4(gen, n, k, 32, False))
        weights = [packed] + [_copies(packed) for _ in range(max(0, -(-L2_BYTES // packed.nbytes) - 1))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        auto = I4.int4_gemv_config(n, k, sms)
        row: dict = {"model": model, "proj": proj, "N": n, "K": k, "auto": dataclasses.astuple(auto)}
        row["auto_us"] = round(graph_us(lambda x_, w_: I4.int4_linear(x_, w_, auto), x, weights), 2)
        for bn in (64, 128):
            for bk in (128, 256):
                per = split_k(-(-n // bn), k, bk, sms, min_steps=2, waves=4)
                for prefetch, stages in ((False, 1), (True, 1), (False, 2)):
                    for warps in (4, 8):
                        cfg = I4.Int4Config(1, bn, bk, per, warps, stages, gemv=True, prefetch=prefetch)
                        try:
                            us = graph_us(lambda x_, w_, cfg=cfg: I4.int4_linear(x_, w_, cfg), x, weights, reps=7)
                        except Exception as exc:   # a config that does not compile: skip
                            row[str(dataclasses.astuple(cfg))] = repr(exc)[:80]
                            continue
                        row[str(dataclasses.astuple(cfg))] = round(us, 2)
        best = min((v, key) for key, v in row.items() if key.startswith("(") and isinstance(v, float))
        row["best"], row["best_us"] = best[1], best[0]
        row["best_GBs"] = round(packed.nbytes / (best[0] * 1e-6) / 1e9)
        rows.append(row)
        print("prefetch", {key: row[key] for key in ("model", "proj", "auto_us", "best", "best_us", "best_GBs")},
              flush=True)
        del weights, packed
        torch.cuda.empty_cache()


def section_tiled(res: dict) -> None:
    """The tiled int4 kernel (group 32) at M = 16 and 64 on the 31B shapes: step width (32 = one group per
    step, 64 / 128 = the tile dequantised first, `scaled`), nibble order, column tile, warps; against auto."""
    rows = res["tiled"] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i, (model, proj, n, k) in enumerate(SHAPES[:4]):
        gen = torch.Generator(device="cuda").manual_seed(i)
        packed = I4.pack_int4(_int4(gen, n, k, 32, False))
        weights = [packed] + [_copies(packed) for _ in range(max(0, -(-L2_BYTES // packed.nbytes) - 1))]
        for m in (16, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            auto = I4.int4_config(m, n, k, 32, sms)
            row: dict = {"model": model, "proj": proj, "N": n, "K": k, "M": m, "auto": dataclasses.astuple(auto)}
            row["auto_us"] = round(graph_us(I4.int4_linear, x, weights), 2)
            bm = 16 if m <= 16 else 64
            for bn in (64, 128):
                for bk, scaled in ((32, False), (64, True), (128, True)):
                    for nibble_major in (False, True):
                        for warps, stages in ((4, 3), (8, 3)):
                            tiles = -(-m // bm) * -(-n // bn)
                            cfg = I4.Int4Config(bm, bn, bk, split_k(tiles, k, bk, sms), warps, stages,
                                                nibble_major=nibble_major, scaled=scaled)
                            try:
                                us = graph_us(lambda x_, w_, cfg=cfg: I4.int4_linear(x_, w_, cfg), x, weights, reps=7)
                            except Exception as exc:   # a config that does not compile (shared memory): skip
                                row[str(dataclasses.astuple(cfg))] = repr(exc)[:80]
                                continue
                            row[str(dataclasses.astuple(cfg))] = round(us, 2)
            best = min((v, key) for key, v in row.items() if key.startswith("(") and isinstance(v, float))
            row["best"], row["best_us"] = best[1], best[0]
            rows.append(row)
            print("tiled", {key: row[key] for key in ("model", "proj", "M", "auto", "auto_us", "best", "best_us")},
                  flush=True)
        del weights, packed
        torch.cuda.empty_cache()


def section_pairs(res: dict) -> None:
    """The pairs kernel (int4_pairs: two weights per instruction, PTX) at M = 1, 4, 16 on every shape (group 32,
    and group 128 with zero points on the 31B): checked against the fp32 product of the bf16-rounded dequantised
    weights, row 0 of M = 16 bit-equal to M = 1, repeats bit-equal; timed against bf16 and the tiled kernel
    (int4_config's choice); on the 31B's qkv a sweep of column tiles, steps, waves, stages and the swapped
    (weights-left) form."""
    from gemmaserve.quantization import int4_pairs as P

    rows = res["pairs"] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i, (model, proj, n, k) in enumerate(SHAPES):
        gen = torch.Generator(device="cuda").manual_seed(i)
        dense = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
        forms = [("g32", _int4(gen, n, k, 32, False))]
        if model == "gemma4-31b":
            forms.append(("g128_asym", _int4(gen, n, k, 128, True)))
        bf16_copies = [dense] + [dense.clone() for _ in range(max(0, -(-L2_BYTES // (n * k * 2)) - 1))]
        for form, w in forms:
            ref_w = w.dequantize(torch.float32).to(torch.bfloat16).float()
            packed = I4.pack_int4(w)
            weights = [packed] + [_copies(packed) for _ in range(max(0, -(-L2_BYTES // packed.nbytes) - 1))]
            x16 = torch.randn(16, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            row: dict = {"model": model, "proj": proj, "form": form, "N": n, "K": k}
            try:
                y16 = P.int4_pairs_linear(x16, packed)
                y1 = P.int4_pairs_linear(x16[:1], packed)
                row["pairs_max_rel_err"] = float(f"{_rel(y16, F.linear(x16.float(), ref_w)):.3g}")
                row["pairs_deterministic"] = bool(torch.equal(y1[0], y16[0])
                                                  and torch.equal(y16, P.int4_pairs_linear(x16, packed)))
            except Exception as exc:
                row["pairs_max_rel_err"], row["pairs_deterministic"], row["error"] = 1.0, False, repr(exc)[:400]
                rows.append(row)
                print("pairs", row, flush=True)
                continue
            for m in (1, 4, 16):
                x = x16[:m].contiguous()
                row[f"M{m}_bf16_us"] = round(graph_us(lambda x_, w_: F.linear(x_, w_), x, bf16_copies), 2)
                row[f"M{m}_tiled_us"] = round(graph_us(I4.int4_linear, x, weights), 2)
                row[f"M{m}_pairs_us"] = round(graph_us(P.int4_pairs_linear, x, weights), 2)
                row[f"M{m}_pairs_GBs"] = round(packed.nbytes / (row[f"M{m}_pairs_us"] * 1e-6) / 1e9)
                if model == "gemma4-31b" and proj == "qkv" and form == "g32" and m in (1, 16):
                    sweep = {}
                    for bn in (64, 128):
                        for bkw in (16, 32):
                            for waves in (2, 4):
                                per = split_k(-(-n // bn), k, 8 * bkw, sms, min_steps=2, waves=waves)
                                for warps, stages in ((4, 3),):
                                    for swap in (False, True):
                                        cfg = P.PairsConfig(bn, bkw, per, warps, stages, swap)
                                        try:
                                            us = graph_us(lambda x_, w_, cfg=cfg: P.int4_pairs_linear(x_, w_, cfg),
                                                          x, weights, reps=5)
                                        except Exception as exc:
                                            sweep[str(dataclasses.astuple(cfg))] = repr(exc)[:80]
                                            continue
                                        sweep[str(dataclasses.astuple(cfg))] = round(us, 2)
                    best = min((v, key) for key, v in sweep.items() if isinstance(v, float))
                    row[f"M{m}_sweep"] = sweep
                    row[f"M{m}_best"], row[f"M{m}_best_us"] = best[1], best[0]
            rows.append(row)
            print("pairs", {key: v for key, v in row.items() if not key.endswith("_sweep")}, flush=True)
            del weights, packed
        del forms, bf16_copies, dense
        torch.cuda.empty_cache()


def section_pairs_sweep(res: dict) -> None:
    """The pairs kernel's configurations on four shapes (the 31B's largest and smallest, E4B's), at 1 and 16 rows:
    column tiles, word rows, waves, stages and the weights' side, for a per-shape choice (any one configuration
    serves every M up to 16, so a row's bits stay independent of the batch)."""
    from gemmaserve.quantization import int4_pairs as P

    rows = res["pairs_sweep"] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i, (model, proj, n, k) in enumerate(SHAPES):
        if (model, proj) not in (("gemma4-31b", "gate_up"), ("gemma4-31b", "o"), ("gemma4-e4b", "qkv"),
                                 ("gemma4-e4b", "gate_up")):
            continue
        gen = torch.Generator(device="cuda").manual_seed(i)
        packed = I4.pack_int4(_int4(gen, n, k, 32, False))
        weights = [packed] + [_copies(packed) for _ in range(max(0, -(-L2_BYTES // packed.nbytes) - 1))]
        x16 = torch.randn(16, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        row: dict = {"model": model, "proj": proj, "N": n, "K": k, "default": str(dataclasses.astuple(
            P.pairs_config(n, k, sms)))}
        for m in (1, 16):
            x = x16[:m].contiguous()
            row[f"M{m}_default_us"] = round(graph_us(P.int4_pairs_linear, x, weights), 2)
            sweep = {}
            for bn in (64, 128, 256):
                for bkw in (16, 32):
                    for waves in (2, 4, 8):
                        per = split_k(-(-n // bn), k, 8 * bkw, sms, min_steps=2, waves=waves)
                        for stages in (3, 4):
                            for swap in (False, True):
                                cfg = P.PairsConfig(bn, bkw, per, 4, stages, swap)
                                try:
                                    us = graph_us(lambda x_, w_, cfg=cfg: P.int4_pairs_linear(x_, w_, cfg), x,
                                                  weights, reps=5)
                                except Exception as exc:
                                    sweep[str(dataclasses.astuple(cfg))] = repr(exc)[:80]
                                    continue
                                sweep[str(dataclasses.astuple(cfg))] = round(us, 2)
            row[f"M{m}_sweep"] = sweep
        both = [(row["M1_sweep"][c] + row["M16_sweep"][c], c) for c in row["M1_sweep"]
                if isinstance(row["M1_sweep"][c], float) and isinstance(row["M16_sweep"].get(c), float)]
        best = min(both)[1]
        row["best_sum"], row["best_M1_us"], row["best_M16_us"] = best, row["M1_sweep"][best], row["M16_sweep"][best]
        rows.append(row)
        print("pairs_sweep", {key: v for key, v in row.items() if not key.endswith("_sweep")}, flush=True)
        del weights, packed
        torch.cuda.empty_cache()


def section_pairs_candidates(res: dict) -> None:
    """The pairs kernel's configurations checked and timed on every shape (group 32; group 128 with zero points
    on the 31B's gate_up): column tiles 128/256, word rows 16/32, four or eight waves, 4 warps (and 8 with 256), the
    weights on either side of the dot. Each is checked as `pairs` checks (the fp32 product of the bf16-rounded
    weights, row 0 of 16 rows against one row, repeats) before it is timed at 1 and 16 rows against the
    configuration on the path (`pairs_config`): where the choice per shape comes from. Writes $OUT/pairs_table.json: the group-32 shapes whose best beats the path's."""
    from gemmaserve.quantization import int4_pairs as P

    rows = res["pairs_candidates"] = []
    table: dict[str, dict] = {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i, (model, proj, n, k) in enumerate(SHAPES):
        gen = torch.Generator(device="cuda").manual_seed(500 + i)
        forms = [("g32", _int4(gen, n, k, 32, False))]
        if model == "gemma4-31b" and proj == "gate_up":
            forms.append(("g128_asym", _int4(gen, n, k, 128, True)))
        for form, w in forms:
            ref_w = w.dequantize(torch.float32).to(torch.bfloat16).float()
            packed = I4.pack_int4(w)
            weights = [packed] + [_copies(packed) for _ in range(max(0, -(-L2_BYTES // packed.nbytes) - 1))]
            x16 = torch.randn(16, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            ref16 = F.linear(x16.float(), ref_w)
            path = P.pairs_config(n, k, sms)
            row: dict = {"model": model, "proj": proj, "form": form, "N": n, "K": k,
                         "path": str(dataclasses.astuple(path))}
            cfgs = [path]
            for bn in (128, 256):
                for bkw in (16, 32):
                    for waves in (4, 8):
                        per = split_k(-(-n // bn), k, 8 * bkw, sms, min_steps=2, waves=waves)
                        for warps in (4, 8) if bn == 256 else (4,):
                            for swap in (False, True):
                                cfgs.append(P.PairsConfig(bn, bkw, per, warps, 3, swap))
            worst, bits_ok, sweep = 0.0, True, {}
            cfg_of = {str(dataclasses.astuple(c)): c for c in cfgs}
            for key, cfg in cfg_of.items():
                try:
                    y16 = P.int4_pairs_linear(x16, packed, cfg)
                    err = _rel(y16, ref16)
                    ok = bool(torch.equal(P.int4_pairs_linear(x16[:1], packed, cfg)[0], y16[0])
                              and torch.equal(P.int4_pairs_linear(x16, packed, cfg), y16))
                    worst, bits_ok = max(worst, err), bits_ok and ok
                    t = [round(graph_us(lambda x_, w_, cfg=cfg: P.int4_pairs_linear(x_, w_, cfg),
                                        x16[:m].contiguous(), weights, reps=7), 2) for m in (1, 16)]
                    sweep[key] = {"err": float(f"{err:.3g}"), "bits": ok, "M1_us": t[0], "M16_us": t[1]}
                except Exception as exc:
                    sweep[key] = repr(exc)[:160]
            row["candidates_max_rel_err"], row["candidates_deterministic"] = float(f"{worst:.3g}"), bits_ok
            timed = {c: v for c, v in sweep.items() if isinstance(v, dict) and v["bits"] and v["err"] <= CHECK_TOL}
            best = min(timed, key=lambda c: timed[c]["M1_us"] + timed[c]["M16_us"])
            row["path_M1_us"], row["path_M16_us"] = sweep[row["path"]]["M1_us"], sweep[row["path"]]["M16_us"]
            row["best"], row["best_M1_us"], row["best_M16_us"] = best, timed[best]["M1_us"], timed[best]["M16_us"]
            row["best_GBs_M1"] = round(packed.nbytes / (timed[best]["M1_us"] * 1e-6) / 1e9)
            row["sweep"] = sweep
            rows.append(row)
            print("pairs_candidates", {key: v for key, v in row.items() if key != "sweep"}, flush=True)
            # group 32 (Google's QAT): a shape's best where it beats the path's by 3% over 1 and 16 rows, for
            # gpu_quant_model --pairs-table
            if form == "g32" and (row["best_M1_us"] + row["best_M16_us"]) < 0.97 * (row["path_M1_us"]
                                                                                  + row["path_M16_us"]):
                table[f"{n},{k}"] = dataclasses.asdict(cfg_of[best])
                (Path(os.environ.get("OUT", "bench-out")) / "pairs_table.json").write_text(json.dumps(table))
            del weights, packed
        del forms
        torch.cuda.empty_cache()


def section_experts(res: dict) -> None:
    """The grouped expert products at the 26B-A4B's shapes (128 experts, gate_up [1408, 2816], down [2816, 704]):
    rows routed at random (top-8 of 128 per token) and sorted by expert, for 1 and 64 tokens; int4 groups of 32
    (symmetric, offset form) and fp8 per channel against their fp32 references, repeated calls bit-equal; and
    microseconds per call in a CUDA graph against bf16 `torch._grouped_mm` over the same rows."""
    from gemmaserve.models.moe import grouped_mm
    from gemmaserve.quantization import grouped_kernels as G

    rows = res["experts"] = []
    experts, top_k = 128, 8
    for proj, n, k in (("gate_up", 2 * 704, 2816), ("down", 2816, 704)):
        gen = torch.Generator(device="cuda").manual_seed(n)
        dense = torch.randn(experts, n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
        forms = {}
        for name, asym in (("int4_g32", False), ("int4_g32_offset", "offset")):
            ws = [_int4(gen, n, k, 32, asym) for _ in range(experts)]
            stacked = Int4Weight(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]), None, 32,
                                 None if asym != "offset" else torch.cat([w.offset for w in ws]))
            qe = G.QuantExperts(stacked, experts)
            forms[name] = (G.int4_grouped_linear, G.pack_int4_experts(qe), qe)
        fe = G.quantize_fp8_experts(dense)
        forms["fp8_channel"] = (G.fp8_grouped_linear, fe, fe)
        for tokens in (1, 64):
            idx = torch.stack([torch.randperm(experts, generator=gen, device="cuda")[:top_k] for _ in range(tokens)])
            counts = torch.bincount(idx.reshape(-1), minlength=experts)
            row_ends = torch.cumsum(counts, 0).to(torch.int32)
            expert_of_row = torch.repeat_interleave(torch.arange(experts, device="cuda"), counts)
            x = torch.randn(tokens * top_k, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            row: dict = {"proj": proj, "N": n, "K": k, "tokens": tokens, "rows": tokens * top_k}
            wt = dense.transpose(1, 2)
            row["bf16_us"] = round(graph_us(lambda x_, w_: grouped_mm(x_, w_, row_ends, expert_of_row), x, [wt]), 2)
            for name, (call, weight, ref_w) in forms.items():
                y = call(x, weight, row_ends)
                ref = G.grouped_reference(x, ref_w, row_ends, torch.float32)
                row[f"{name}_max_rel_err"] = float(f"{_rel(y, ref):.3g}")
                row[f"{name}_deterministic"] = all(torch.equal(y, call(x, weight, row_ends)) for _ in range(3))
                us = graph_us(lambda x_, w_, call=call: call(x_, w_, row_ends), x, [weight])
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_speedup"] = round(row["bf16_us"] / us, 2)
            rows.append(row)
            print("experts", row, flush=True)
        del forms, dense
        torch.cuda.empty_cache()


def summary(res: dict) -> str:
    lines = [f"{res['device']}  torch {res['torch']}  copy bandwidth {res.get('hbm_GBs')} GB/s"]
    checks = res.get("check")
    if isinstance(checks, list):
        lines.append("check: max relative error of the bf16 output against the fp32 reference over M = 1..64")
        for r in checks:
            errs = "  ".join(f"{key.removesuffix('_max_rel_err')} {v:.1e}" for key, v in r.items()
                             if key.endswith("_max_rel_err"))
            varying = [key.removesuffix("_deterministic") for key, v in r.items() if key.endswith("_deterministic")
                       and not v]
            lines.append(f"  {r['model']:<11} {r['proj']:<8} {errs}" +
                         (f"  BITS VARY: {' '.join(varying)}" if varying else ""))
    timing = res.get("timing")
    if isinstance(timing, list):
        lines.append("timing: us per call (fraction of copy bandwidth)  [speedup over bf16]")
        lines.append(f"  {'model':<11} {'proj':<8} {'M':>3}  " + "  ".join(f"{m:>22}" for m in METHODS))
        for r in timing:
            cells = [f"{r[f'{m}_us']:>7.1f} ({r.get(f'{m}_of_copy_bw', 0):.2f}) [{r[f'{m}_speedup']:.2f}x]"
                     for m in METHODS]
            lines.append(f"  {r['model']:<11} {r['proj']:<8} {r['M']:>3}  " + "  ".join(f"{c:>22}" for c in cells))
    for r in res.get("tiled") if isinstance(res.get("tiled"), list) else []:
        lines.append(f"tiled {r['model']} {r['proj']} M={r['M']}: auto {r['auto']} {r['auto_us']} us; "
                     f"best {r['best']} {r['best_us']} us")
    sweep = res.get("sweep")
    if isinstance(sweep, list):
        for r in sweep:
            lines.append(f"sweep {r['model']} {r['proj']} M={r.get('M', 1)}: auto {r['auto']} {r['auto_us']} us ({r['auto_GBs']} GB/s); "
                         f"best {r['best']} {r['best_us']} us ({r['best_GBs']} GB/s)")
    return "\n".join(lines)


CHECKS = {"check": check_row_ok, "experts": check_row_ok, "pairs": check_row_ok,
          "pairs_candidates": check_row_ok}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sections", nargs="*", default=["hbm", "check", "timing", "sweep"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_quant needs CUDA", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT", "bench-out")) / "gpu_quant.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                 "capability": list(torch.cuda.get_device_capability())}

    def hbm() -> None:
        from gemmaserve.bench.gpu_check import copy_bandwidth

        res["hbm_GBs"] = round(copy_bandwidth())

    run_sections(res, args.sections, {
        "hbm": hbm,
        "check": lambda: section_check(res),
        "timing": lambda: section_timing(res, res.get("hbm_GBs")),
        "sweep": lambda: section_sweep(res),
        "tiled": lambda: section_tiled(res),
        "prefetch": lambda: section_prefetch(res),
        "experts": lambda: section_experts(res),
        "pairs": lambda: section_pairs(res),
        "pairs_sweep": lambda: section_pairs_sweep(res),
        "pairs_candidates": lambda: section_pairs_candidates(res),
    }, out)
    print(summary(res))
    return exit_status(res, CHECKS)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
