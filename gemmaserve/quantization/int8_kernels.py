"""y = x @ dequant(w)^T over int8 group weights (schemes.Int8Weight: w = scale * q, one scale per g inputs), the
scales fused into the product: Triton on CUDA (and on the CPU under TRITON_INTERPRET=1), the fp32 reference
elsewhere. No dequantised copy of the weight is ever made on the Triton path; y has x's dtype, accumulated in
fp32. The int4 kernels' twin (int4_kernels.py): the same regimes, grids and deterministic split-K.

Layout (`Int8Packed`, made once at load by `pack_int8`):

    qweight  int32 [K/4, N]   word (r, n) holds q[n, 4r + i] in bits 8i..8i+7 (i = 0..3, two's complement):
                              packed along K, stored K-major so that a program's load of one word row is BN
                              consecutive columns (coalesced)
    scale    [K/g, N]         the source's float dtype (fp16 or fp32), read as fp32 in the kernel: exact

Two kernels:

* GEMV (up to 4 rows; chosen explicitly, `int8_gemv_config`): no tl.dot. A program owns BN columns and a
  slice of K for all its rows; each step loads BKW word rows and, byte by byte, multiplies them into the rows on
  the FMA units. A byte becomes a float by the exponent trick: flipping its sign bit maps q (-128..127) onto
  q + 128 (0..255), and (q + 128) | 0x4B000000 read as fp32 is 2^23 + 128 + q, so one subtraction gives q
  exactly. A word's 4 values lie in one group (4 divides g): its 4 products are summed, then scaled once.
* tiled (larger M): a program owns a BM x BN output tile and a slice of K; each step multiplies x's [BM, BK] tile
  by the step's integers (-128..127: exact in bf16, fp16 and fp32) with tl.dot (exact products, fp32 sums) and adds
  that partial times the group's scale: BK divides the group, so no weight is ever rounded to x's dtype after
  scaling.

Split K (both): each slice writes its fp32 partial into [splits, M, N], and the partials are summed in a fixed
order (deterministic: the same input gives the same bits on every run; no atomics). Everything a launch allocates
is shaped by (M, N) alone and nothing is read back: a CUDA graph can capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import check_input, grouped_tile, sm_count, split_k, split_output, sum_splits, triton_enabled
from .schemes import Int8Weight, check_group

SMALL_M = 16   # rows up to which the tiled kernel's decode configuration (BM = 16, split-K) serves


@dataclass(frozen=True)
class Int8Packed:
    qweight: torch.Tensor   # int32 [K/4, N]
    scale: torch.Tensor     # [K/g, N], float (the source's dtype)
    n: int
    k: int
    group: int

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise ValueError(f"int8 weight with {self.n} output columns")
        check_group(self.group, self.k, "int8")
        if self.qweight.dtype != torch.int32 or tuple(self.qweight.shape) != (self.k // 4, self.n):
            raise ValueError(f"packed int8 weight {self.qweight.dtype} {tuple(self.qweight.shape)}, expected "
                             f"torch.int32 {(self.k // 4, self.n)}")
        if tuple(self.scale.shape) != (self.k // self.group, self.n) or not self.scale.is_floating_point():
            raise ValueError(f"packed int8 scale {self.scale.dtype} {tuple(self.scale.shape)}, expected a float "
                             f"{(self.k // self.group, self.n)}")
        if not (self.qweight.is_contiguous() and self.scale.is_contiguous()):
            raise ValueError("packed int8 tensors must be contiguous (the kernel reads rows of N columns)")

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        """Bytes a product reads from the weight (packed values and scales)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale))


def pack_int8(w: Int8Weight) -> Int8Packed:
    """An Int8Weight in the kernel's layout (module docstring), on w's device; scales keep their dtype. The bytes
    are moved, never computed: [K/4, N, 4] int8 read as int32 is the layout on little-endian hosts and GPUs."""
    n, k = w.shape
    check_group(w.group, k, "int8")
    quads = w.q.t().reshape(k // 4, 4, n).permute(0, 2, 1).contiguous()   # [K/4, N, 4]: byte i = q[n, 4r + i]
    return Int8Packed(quads.view(torch.int32).view(k // 4, n), w.scale.t().contiguous(), n, k, w.group)


def unpack_int8(p: Int8Packed) -> Int8Weight:
    """The Int8Weight that `p` packs (exactly: values, scales in their dtype)."""
    q = p.qweight.view(torch.int8).view(p.k // 4, p.n, 4).permute(1, 0, 2).reshape(p.n, p.k).contiguous()
    return Int8Weight(q, p.scale.t().contiguous(), p.group)


@dataclass(frozen=True)
class Int8Config:
    block_m: int
    block_n: int
    block_k: int       # K elements per step: divides the group (tiled); a multiple of 4 (GEMV)
    k_per_split: int   # K elements per program (a multiple of block_k, of 4 for the GEMV); K: no split
    num_warps: int
    num_stages: int
    gemv: bool = False   # the decode GEMV kernel (block_m rows at once, no tl.dot) instead of the tiled one

    def splits(self, k: int) -> int:
        return -(-k // self.k_per_split)


def int8_gemv_config(n: int, k: int, sms: int) -> Int8Config:
    """The GEMV's tiles for one row (the int4 GEMV's H100 sweep: 64 columns, 128 K values a step, about four
    waves); not int8_config's choice, as for int4 (a row's bits would then depend on its batch)."""
    bn, bk = 64, 128
    return Int8Config(1, bn, bk, split_k(-(-n // bn), k, bk, sms, min_steps=2, waves=4), 4, 1, gemv=True)


def int8_config(m: int, n: int, k: int, group: int, sms: int) -> Int8Config:
    """Tiles by batch regime (no autotuning: one compile per regime and shape), as int4_config: narrow tl.dot
    tiles split along K up to SMALL_M (the same for every M there: a row's bits do not depend on its batch), then
    wider tiles, still split while M <= 64. Untuned on a GPU."""
    if m <= SMALL_M:
        bm, bn, bk, warps, stages = 16, 64, min(group, 128), 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 64, min(group, 64), 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 128, min(group, 64), 8, 3
    tiles = -(-m // bm) * -(-n // bn)
    per_split = split_k(tiles, k, bk, sms) if m <= 64 else k
    return Int8Config(bm, bn, bk, per_split, warps, stages)


def _precision(dtype: torch.dtype) -> str:
    """fp32 x stays fp32 (tf32 would round it); bf16/fp16 products with int8 values are exact either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit(do_not_specialize=["M"])
def _int8_kernel(x_ptr, qw_ptr, s_ptr, y_ptr, M, N, K, k_per_split, s_xm, s_xk, s_ym, s_yn,
                 GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 PRECISION: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    pid_k = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    mm = rm < M
    nm = rn < N
    rk = tl.arange(0, BK)
    rw = tl.arange(0, BK // 4)
    shifts = tl.arange(0, 4) * 8
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):   # whole steps: BK divides the group, the group divides K
        a = tl.load(x_ptr + rm[:, None] * s_xm + (k0 + rk)[None, :] * s_xk, mask=mm[:, None], other=0.0)
        words = tl.load(qw_ptr + ((k0 // 4 + rw) * N)[:, None] + rn[None, :], mask=nm[None, :], other=0)
        # Row 4r + i: byte i of word row r, sign-extended ((b ^ 0x80) - 0x80 maps 0..255 onto -128..127).
        q = tl.reshape((((words[:, None, :] >> shifts[None, :, None]) & 0xFF) ^ 0x80) - 0x80, (BK, BN))
        scale = tl.load(s_ptr + (k0 // GROUP) * N + rn, mask=nm, other=0.0).to(tl.float32)
        part = tl.dot(a, q.to(a.dtype), input_precision=PRECISION, out_dtype=tl.float32)
        acc += part * scale[None, :]
    # A K slice writes its own fp32 partial (y is [splits, M, N] then): the host sums them in a fixed order.
    ptrs = y_ptr + pid_k.to(tl.int64) * M * N + rm[:, None] * s_ym + rn[None, :] * s_yn
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["M"])
def _int8_gemv_kernel(x_ptr, qw_ptr, s_ptr, y_ptr, M, N, K, k_per_split, s_xm, s_xk, s_ym, s_yn,
                      GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr):
    """Decode rows without tl.dot (module docstring): BN columns, a K slice, all BM (<= 4) rows; BKW word rows
    (4 K values each) a step, one scale per word row."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    nm = rn < N
    rm = tl.arange(0, BM)
    mm = rm < M
    rw = tl.arange(0, BKW)
    words_total = K // 4
    w_lo = pid_k * (k_per_split // 4)
    w_hi = tl.minimum(w_lo + k_per_split // 4, words_total)
    acc = tl.zeros((BM, BKW, BN), dtype=tl.float32)
    for w0 in range(w_lo, w_hi, BKW):
        wr = w0 + rw
        wm = wr < w_hi
        lm = wm[:, None] & nm[None, :]
        words = tl.load(qw_ptr + wr.to(tl.int64)[:, None] * N + rn[None, :], mask=lm, other=0)
        g = (wr * 4) // GROUP
        scale = tl.load(s_ptr + g[:, None] * N + rn[None, :], mask=lm, other=0.0).to(tl.float32)
        part = tl.zeros((BM, BKW, BN), dtype=tl.float32)
        for i in tl.static_range(4):
            # 2^23 + 128 + q, exactly: the byte with its sign bit flipped, in the mantissa of 2^23.
            qf = ((((words >> (8 * i)) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            xi = tl.load(x_ptr + rm[:, None] * s_xm + (wr * 4 + i)[None, :] * s_xk,
                         mask=mm[:, None] & wm[None, :], other=0.0).to(tl.float32)
            part += xi[:, :, None] * qf[None, :, :]
        acc += part * scale[None, :, :]
    y = tl.sum(acc, axis=1)
    ptrs = y_ptr + pid_k.to(tl.int64) * M * N + rm[:, None] * s_ym + rn[None, :] * s_yn
    tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def int8_linear(x: torch.Tensor, w: Int8Packed, config: Int8Config | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32) @ dequant(w)^T -> [..., N] in x's dtype. `config` overrides the tile
    choice (tests force each regime; benchmarks sweep); without Triton (CPU, no interpreter) the reference."""
    check_input(x, w.n, w.k, "int8_linear")
    if not triton_enabled(x.device):
        return int8_linear_reference(x, w)
    x2 = x.reshape(-1, w.k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], w.n)
    cfg = config or int8_config(m, w.n, w.k, w.group, sm_count(x.device))
    if (cfg.k_per_split % 4 or cfg.block_k % 4) if cfg.gemv else (cfg.k_per_split % cfg.block_k or
                                                                  w.group % cfg.block_k or cfg.block_k < 16):
        raise ValueError(f"int8 config {cfg}: block_k must divide the group {w.group} and the K slice and be at "
                         "least 16 (the GEMV kernel: both multiples of 4)")
    if cfg.gemv and m > cfg.block_m:
        raise ValueError(f"int8 config {cfg}: the GEMV kernel takes at most block_m = {cfg.block_m} rows, got {m}")
    splits = cfg.splits(w.k)
    y = split_output(splits, m, w.n, x)
    args = (x2, w.qweight, w.scale, y, m, w.n, w.k, cfg.k_per_split, x2.stride(0), x2.stride(1),
            y.stride(-2), y.stride(-1))
    if cfg.gemv:
        _int8_gemv_kernel[(triton.cdiv(w.n, cfg.block_n), splits)](
            *args, GROUP=w.group, BM=cfg.block_m, BN=cfg.block_n, BKW=cfg.block_k // 4,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(w.n, cfg.block_n), splits)
        _int8_kernel[grid](*args, GROUP=w.group, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=8,
                           PRECISION=_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return sum_splits(y, splits, x, w.n)


def int8_linear_reference(x: torch.Tensor, w: Int8Packed | Int8Weight) -> torch.Tensor:
    """The contract: x @ (schemes' fp32 dequantisation)^T in fp32, cast to x's dtype (materialises the weight)."""
    weight = unpack_int8(w) if isinstance(w, Int8Packed) else w
    return F.linear(x.float(), weight.dequantize(torch.float32).to(x.device)).to(x.dtype)
