"""The int4 decode product for bf16 activations and bf16 scales (Google's QAT, llm-compressor's W4A16 exports),
its weights dequantised two at a time: y = x @ dequant(w)^T for up to SMALL_M rows.

The tiled kernel (int4_kernels) turns every nibble into a float on its own: a shift, a mask, an OR, an fp32
subtract and multiply and a conversion to bf16, about seven single-lane instructions a weight. At one token a step
that is more arithmetic than the H100's integer and FMA pipes finish in the time HBM delivers the packed bytes,
so it streamed weights at ~0.28 of the bandwidth. Here one PTX sequence per pair of packed words yields 16
dequantised bf16 weights in eight 32-bit registers, two weights per instruction:

    prmt      byte j of each of the two words into the two halves of one register
    and, or   the low (then, after a shift, the high) nibble of each half under the exponent 0x43: the bf16
              value 128 + q in each half (lop3 after ptxas)
    fma.bf16x2  (128 + q) * 1 - (128 + zero): q - zero, exact (small integers)
    fma.bf16x2  (q - zero) * scale + (-0): the product rounded once to bf16

That is the same weight, bit for bit, as the scaled path's fp32 product rounded to bf16 (an exact product rounded
once either way), so the result is x times the bf16-rounded dequantised weight accumulated in fp32, as a bf16
checkpoint's weight would be. The eight registers are nibble planes: plane i holds K index 8r + i of word row r,
so each plane meets x's columns 8r + i in its own tl.dot (K = BKW word rows per dot).

Off CUDA (Triton's interpreter, the tests) `ASM` is off and the same planes come from Triton arithmetic that
rounds the same way: the kernel's structure (tiles, split-K, dot order) is the one the GPU runs.

Every M up to SMALL_M takes the same tiles and K split, so a row's bits do not depend on the rows beside it.

The engine's decode path for these weights (quantization/linear.py; int4_kernels serves the rest). On an H100
(`python -m benchmarks.gpu_quant hbm pairs`, 2026-12-07) the PTX planes were exact to the fp32 product of the
bf16-rounded weights (relative error 1.7e-3, bf16 output rounding), repeatable and batch-independent, and the
31B's projections took 0.5-0.6x the tiled kernel's time at one row (1.0-1.5 TB/s of packed weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .int4_kernels import Int4Packed
from .launch import check_input, sm_count, split_k, split_output, sum_splits, triton_enabled

SMALL_M = 16

# Operands: $0..$7 the eight nibble planes (bf16x2: word a's weight in the low half, word b's in the high),
# $8 $9 the two packed words, $10 -(128 + zero) for each (bf16x2), $11 their scales (bf16x2).
_PLANE = """
prmt.b32 p, $8, $9, {sel};
and.b32 t, p, 0x000F000F;
or.b32 t, t, 0x43004300;
fma.rn.bf16x2 t, t, one, $10;
fma.rn.bf16x2 ${lo}, t, $11, nz;
shr.b32 p, p, 4;
and.b32 t, p, 0x000F000F;
or.b32 t, t, 0x43004300;
fma.rn.bf16x2 t, t, one, $10;
fma.rn.bf16x2 ${hi}, t, $11, nz;
"""
_DEQUANT_ASM = tl.constexpr("{\n.reg .b32 p, t, one, nz;\nmov.b32 one, 0x3F803F80;\nmov.b32 nz, 0x80008000;\n"
                + "".join(_PLANE.format(sel=hex(j | j << 4 | (4 + j) << 8 | (4 + j) << 12), lo=2 * j, hi=2 * j + 1)
                          for j in range(4)) + "}")
_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r")


@triton.jit
def _planes_asm(words, neg_base, scale):
    return tl.inline_asm_elementwise(_DEQUANT_ASM, _CONSTRAINTS, [words, neg_base, scale],
                                     dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                                            tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


@triton.jit
def _plane(words, i: tl.constexpr, neg_base, scale):
    """Plane i in Triton arithmetic, rounded as the PTX rounds it: (q - zero) * scale exact in fp32, then bf16."""
    q = ((words >> (4 * i)) & 0xF).to(tl.float32) + 128.0 + neg_base.to(tl.float32)
    bits = (q * scale.to(tl.float32)).to(tl.int32, bitcast=True)
    # to nearest, ties to even, by hand: the interpreter's fp32 -> bf16 conversion does not round so
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _dot(a, b, acc, ASM: tl.constexpr):
    """bf16 operands, fp32 sums; off the GPU in fp32 (ieee), the same products and sums (the interpreter's
    bf16 dot is unreliable)."""
    if ASM:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit(do_not_specialize=["M"])
def _int4_pairs_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, M, N, K, k_per_split, s_xm, s_xk, s_ym, s_yn,
                       GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BKW: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr):
    """A program owns BN columns, BM rows and a K slice. SWAP computes the transposed tile (weights as the
    dot's left operand, [BN, BKW] x [BKW, BM]): on Hopper the left operand may come from registers."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    mm = rm < M
    rn = pid_n * BN + tl.arange(0, BN)
    nm = rn < N
    rw = tl.arange(0, BKW)
    w_lo = pid_k * (k_per_split // 8)
    w_hi = tl.minimum(w_lo + k_per_split // 8, K // 8)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for w0 in range(w_lo, w_hi, BKW):
        wr = w0 + rw
        wm = wr < w_hi
        if SWAP:   # tiles [BN, BKW]
            idx = wr[None, :].to(tl.int64) * N + rn[:, None]
            lm = nm[:, None] & wm[None, :]
            gidx = ((wr * 8) // GROUP)[None, :] * N + rn[:, None]
        else:      # tiles [BKW, BN]
            idx = wr[:, None].to(tl.int64) * N + rn[None, :]
            lm = wm[:, None] & nm[None, :]
            gidx = ((wr * 8) // GROUP)[:, None] * N + rn[None, :]
        words = tl.load(qw_ptr + idx, mask=lm, other=0)
        scale = tl.load(s_ptr + gidx, mask=lm, other=0.0)
        if HAS_ZERO:
            neg_base = (-128.0 - tl.load(z_ptr + gidx, mask=lm, other=0).to(tl.float32)).to(tl.bfloat16)
        else:
            neg_base = tl.full(words.shape, -136.0, tl.bfloat16)
        if ASM:
            p0, p1, p2, p3, p4, p5, p6, p7 = _planes_asm(words, neg_base, scale)
        else:
            p0 = _plane(words, 0, neg_base, scale)
            p1 = _plane(words, 1, neg_base, scale)
            p2 = _plane(words, 2, neg_base, scale)
            p3 = _plane(words, 3, neg_base, scale)
            p4 = _plane(words, 4, neg_base, scale)
            p5 = _plane(words, 5, neg_base, scale)
            p6 = _plane(words, 6, neg_base, scale)
            p7 = _plane(words, 7, neg_base, scale)
        # x's columns 8r + i for plane i: [BM, BKW] (or its transpose), masked rows and steps read as zero
        if SWAP:
            xp = x_ptr + rm[None, :] * s_xm + (wr * 8)[:, None].to(tl.int64) * s_xk
            xm = wm[:, None] & mm[None, :]
            acc = _dot(p0, tl.load(xp + 0 * s_xk, mask=xm, other=0.0), acc, ASM)
            acc = _dot(p1, tl.load(xp + 1 * s_xk, mask=xm, other=0.0), acc, ASM)
            acc = _dot(p2, tl.load(xp + 2 * s_xk, mask=xm, other=0.0), acc, ASM)
            acc = _dot(p3, tl.load(xp + 3 * s_xk, mask=xm, other=0.0), acc, ASM)
            acc = _dot(p4, tl.load(xp + 4 * s_xk, mask=xm, other=0.0), acc, ASM)
            acc = _dot(p5, tl.load(xp + 5 * s_xk, mask=xm, other=0.0), acc, ASM)
            acc = _dot(p6, tl.load(xp + 6 * s_xk, mask=xm, other=0.0), acc, ASM)
            acc = _dot(p7, tl.load(xp + 7 * s_xk, mask=xm, other=0.0), acc, ASM)
        else:
            xp = x_ptr + rm[:, None] * s_xm + (wr * 8)[None, :].to(tl.int64) * s_xk
            xm = mm[:, None] & wm[None, :]
            acc = _dot(tl.load(xp + 0 * s_xk, mask=xm, other=0.0), p0, acc, ASM)
            acc = _dot(tl.load(xp + 1 * s_xk, mask=xm, other=0.0), p1, acc, ASM)
            acc = _dot(tl.load(xp + 2 * s_xk, mask=xm, other=0.0), p2, acc, ASM)
            acc = _dot(tl.load(xp + 3 * s_xk, mask=xm, other=0.0), p3, acc, ASM)
            acc = _dot(tl.load(xp + 4 * s_xk, mask=xm, other=0.0), p4, acc, ASM)
            acc = _dot(tl.load(xp + 5 * s_xk, mask=xm, other=0.0), p5, acc, ASM)
            acc = _dot(tl.load(xp + 6 * s_xk, mask=xm, other=0.0), p6, acc, ASM)
            acc = _dot(tl.load(xp + 7 * s_xk, mask=xm, other=0.0), p7, acc, ASM)
    base = y_ptr + pid_k.to(tl.int64) * M * N
    if SWAP:
        tl.store(base + rm[None, :] * s_ym + rn[:, None] * s_yn, acc.to(y_ptr.dtype.element_ty),
                 mask=nm[:, None] & mm[None, :])
    else:
        tl.store(base + rm[:, None] * s_ym + rn[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])


@dataclass(frozen=True)
class PairsConfig:
    block_n: int
    block_kw: int      # word rows per step (8 K values each): the K of each plane's dot, a multiple of 16
    k_per_split: int   # K values per program (a multiple of 8 * block_kw)
    num_warps: int
    num_stages: int
    swap: bool = False
    block_m: int = SMALL_M

    def splits(self, k: int) -> int:
        return -(-k // self.k_per_split)


def pairs_config(n: int, k: int, sms: int) -> PairsConfig:
    """One configuration for every M up to SMALL_M (row bits independent of the batch), from gpu_quant's
    `pairs_candidates` on an H100 (docs/gpu_quant_pairs_candidates_2026-12-07_h100.json: 36 configurations a shape,
    each checked, timed at 1 and 16 rows): 128 columns, 16 word rows, four waves and the weights on the dot's left
    were the best or within 3% on ten of the twelve Gemma 4 shapes. Two exceptions: the widest products (200+
    tiles of 128 columns: the 31B's and 12B's gate_up) take 256 columns with the weights on the right (31B:
    71 / 91 us at 1 / 16 rows against 98 / 110; with group 128 and zero points 97 / 122 against 97 / 117), and the
    longest K (16K+: the 31B's down) eight waves (48 / 53 against 50 / 54)."""
    if -(-n // 128) >= 200:
        bn, swap, waves = 256, False, 4
    else:
        bn, swap, waves = 128, True, 8 if k >= 16384 else 4
    bkw = 16
    return PairsConfig(bn, bkw, split_k(-(-n // bn), k, 8 * bkw, sms, min_steps=2, waves=waves), 4, 3, swap=swap)


def pairs_eligible(x: torch.Tensor, w: Int4Packed) -> bool:
    """bf16 rows up to SMALL_M over bf16 scales without offsets, where our Triton kernels run."""
    return (triton_enabled(x.device) and x.dtype == torch.bfloat16 and w.scale.dtype == torch.bfloat16
            and not w.has_offset and x.numel() // w.k <= SMALL_M and x.numel() > 0)


def int4_pairs_linear(x: torch.Tensor, w: Int4Packed, config: PairsConfig | None = None) -> torch.Tensor:
    """x [..., K] bf16 @ dequant(w)^T -> [..., N] bf16 for at most SMALL_M rows (`pairs_eligible`)."""
    check_input(x, w.n, w.k, "int4_pairs_linear")
    if not pairs_eligible(x, w):
        raise ValueError("int4_pairs_linear takes bf16 rows up to 16 over bf16 scales without offsets, on CUDA "
                         "or in Triton's interpreter")
    x2 = x.reshape(-1, w.k)
    m = x2.shape[0]
    cfg = config or pairs_config(w.n, w.k, sm_count(x.device))
    if cfg.k_per_split % (8 * cfg.block_kw) or cfg.block_kw % 16:
        raise ValueError(f"int4 pairs config {cfg}: block_kw a multiple of 16, the K slice of 8 * block_kw")
    splits = cfg.splits(w.k)
    y = split_output(splits, m, w.n, x)
    asm = x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) >= (8, 0)
    _int4_pairs_kernel[(triton.cdiv(w.n, cfg.block_n), splits, triton.cdiv(m, cfg.block_m))](
        x2, w.qweight, w.scale, w.zero if w.zero is not None else w.scale, y, m, w.n, w.k, cfg.k_per_split,
        x2.stride(0), x2.stride(1), y.stride(-2), y.stride(-1), GROUP=w.group, HAS_ZERO=w.has_zero,
        BM=cfg.block_m, BN=cfg.block_n, BKW=cfg.block_kw, SWAP=cfg.swap, ASM=asm, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return sum_splits(y, splits, x, w.n)
