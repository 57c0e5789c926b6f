"""y = x @ dequant(w)^T over int4 group weights (schemes.Int4Weight), the dequantisation fused into the product:
Triton on CUDA (and on the CPU under TRITON_INTERPRET=1), the fp32 reference elsewhere. No dequantised copy
of the weight is ever made on the Triton path; y has x's dtype, accumulated in fp32.

Layout (`Int4Packed`, made once at load by `pack_int4`):

    qweight  int32 [K/8, N]   word (r, n) holds q[n, 8r + i] in bits 4i..4i+3 (i = 0..7): packed along K,
                              stored K-major so that a program's load of one word row is BN consecutive
                              columns (coalesced, 16-byte vectors per thread)
    scale    [K/g, N]         the checkpoint's float dtype, as saved (read as fp32 in the kernel: exact)
    zero     uint8 [K/g, N]   0..15, or None: symmetric, zero = 8 (a compile-time constant)
    offset   [K/g, N]         the offset form's float offsets (w = s q - offset), or None; never with zero

Two kernels (their tiles by `int4_config` and `int4_gemv_config`; each slice of a split K writes its fp32
partial and the partials are summed in a fixed order, so the same input gives the same bits on every run):

* GEMV (up to 4 rows; only when asked for, `int4_gemv_config`: int4_config keeps one kernel for every decode
  batch, see there): no tl.dot. A program owns BN columns and a K slice for all rows; per word row it turns
  each nibble into q - zero in fp32 by the exponent trick (no int-to-float conversion), multiplies the rows'
  x into it on the FMA units, sums the word's 8 products and scales that sum by the word's group scale.
  Column tiles times K slices (launch.split_k) keep every multiprocessor streaming packed weights.
* tiled (larger M, and M up to SMALL_M with BM = 16): a program owns a BM x BN output tile and a slice of K.
  Each step loads BK/8 word rows, unpacks them into the integers q - zero (-15..15, exact in bf16, fp16 and
  fp32), multiplies x's [BM, BK] tile by them with tl.dot (exact products, fp32 sums) and adds that partial
  times the group's scale to the accumulator: BK divides g, so the scale multiplies once per group and column
  and no weight is rounded to x's dtype after scaling (a bf16 scale times a 4-bit integer needs 12 bits of
  mantissa; bf16 has 8). `scaled` steps instead span groups (BK > g, wider loads for g = 32): the tile is
  dequantised in fp32 (exact) and rounded to x's dtype before one tl.dot, as a bf16 checkpoint's weights would
  be. `nibble_major` unpacks the words nibble by nibble (no interleaving reshape) and gathers x's columns in
  that order instead.

The offset form (GGUF Q4_K, Q4_1) multiplies x by the raw q (0..15) instead, and subtracts per step (per word,
in the GEMV) the sums of x times the group's offset: sum_k x (s q - o) = s sum_k x q - o sum_k x inside one
group. That is the same value in exact arithmetic, not the same bits as dequantise-then-multiply: the two fp32
terms are rounded apart before they cancel (an error of fp32 rounding of |s sum x q| + |o sum x|, far below
bf16's rounding of a dequantised weight, but not zero).

Everything a launch allocates is shaped by (M, N) alone and nothing is read back: a CUDA graph can capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import check_input, grouped_tile, sm_count, split_k, split_output, sum_splits, triton_enabled
from .schemes import Int4Weight

SMALL_M = 16   # rows up to which the decode configuration of the tiled kernel (BM = 16, split-K) serves


@dataclass(frozen=True)
class Int4Packed:
    qweight: torch.Tensor          # int32 [K/8, N]
    scale: torch.Tensor            # [K/g, N], float (checkpoint dtype)
    zero: torch.Tensor | None      # uint8 [K/g, N], or None (symmetric: 8, or the offset form)
    n: int
    k: int
    group: int
    offset: torch.Tensor | None = None   # [K/g, N], float: w = s q - offset (then zero is None)

    def __post_init__(self) -> None:
        check_geometry(self.n, self.k, self.group)
        if self.qweight.dtype != torch.int32 or tuple(self.qweight.shape) != (self.k // 8, self.n):
            raise ValueError(f"packed int4 weight {self.qweight.dtype} {tuple(self.qweight.shape)}, expected "
                             f"torch.int32 {(self.k // 8, self.n)}")
        if tuple(self.scale.shape) != (self.k // self.group, self.n) or not self.scale.is_floating_point():
            raise ValueError(f"packed int4 scale shape {tuple(self.scale.shape)} ({self.scale.dtype}), expected "
                             f"a float {(self.k // self.group, self.n)}")
        if self.zero is not None and (tuple(self.zero.shape) != (self.k // self.group, self.n)
                                      or self.zero.dtype != torch.uint8):
            raise ValueError(f"packed int4 zero point {self.zero.dtype} {tuple(self.zero.shape)}, expected "
                             f"torch.uint8 {(self.k // self.group, self.n)}")
        if self.offset is not None:
            if self.zero is not None:
                raise ValueError("a packed int4 weight has a zero point or an offset, not both")
            if tuple(self.offset.shape) != (self.k // self.group, self.n) or not self.offset.is_floating_point():
                raise ValueError(f"packed int4 offset {self.offset.dtype} {tuple(self.offset.shape)}, expected "
                                 f"a float {(self.k // self.group, self.n)}")
        for t in (self.qweight, self.scale, self.zero, self.offset):
            if t is not None and not t.is_contiguous():
                raise ValueError("packed int4 tensors must be contiguous (the kernel reads rows of N columns)")

    @property
    def has_zero(self) -> bool:
        return self.zero is not None

    @property
    def has_offset(self) -> bool:
        return self.offset is not None

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        """Bytes a product reads from the weight (packed values, scales, zero points or offsets)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.zero, self.offset)
                   if t is not None)


def check_geometry(n: int, k: int, group: int) -> None:
    """The kernel's limits: K a multiple of the group, the group a power of two >= 16 (a tl.dot step)."""
    if group < 16 or group & (group - 1):
        raise ValueError(f"int4 group size {group} is not a power of two >= 16")
    if k <= 0 or k % group:
        raise ValueError(f"int4 group size {group} does not divide the input width K = {k}")
    if n <= 0:
        raise ValueError(f"int4 weight with {n} output columns")


def pack_int4(w: Int4Weight) -> Int4Packed:
    """An Int4Weight in the kernel's layout (module docstring), on w's device; scales keep their dtype."""
    n, k = w.shape
    check_geometry(n, k, w.group)
    if w.q.dtype != torch.uint8:
        raise ValueError(f"int4 values must be uint8 0..15, got {w.q.dtype}")
    nib = w.q.t().reshape(k // 8, 8, n).to(torch.int32)           # [K/8, 8, N]: nibble i of word row r
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.q.device)[None, :, None]
    # Summing disjoint bit fields is an OR; int32 wraps for nibble 7 >= 8 (the sign bit), as intended.
    words = (nib << shifts).sum(dim=1, dtype=torch.int64)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    zero = None if w.zero is None else w.zero.t().contiguous()
    offset = None if w.offset is None else w.offset.t().contiguous()
    return Int4Packed(words.contiguous(), w.scale.t().contiguous(), zero, n, k, w.group, offset)


def unpack_int4(p: Int4Packed) -> Int4Weight:
    """The Int4Weight that `p` packs (exactly: values, scales in their dtype, zero points or offsets)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=p.qweight.device)[None, :, None]
    q = ((p.qweight[:, None, :] >> shifts) & 0xF).reshape(p.k, p.n).t().to(torch.uint8).contiguous()
    zero = None if p.zero is None else p.zero.t().contiguous()
    offset = None if p.offset is None else p.offset.t().contiguous()
    return Int4Weight(q, p.scale.t().contiguous(), zero, p.group, offset)


@dataclass(frozen=True)
class Int4Config:
    block_m: int
    block_n: int
    block_k: int       # K elements per step: divides the group (tl.dot path); a multiple of 8 (GEMV path)
    k_per_split: int   # K elements per program (a multiple of block_k); K: no split
    num_warps: int
    num_stages: int
    gemv: bool = False   # the decode GEMV kernel (block_m rows at once, no tl.dot) instead of the tiled one
    nibble_major: bool = False   # tiled kernel: unpack nibble-major and gather x's columns to match
    scaled: bool = False   # tiled kernel: dequantise the tile into x's dtype first (block_k may span groups)
    prefetch: bool = False   # GEMV: load the next step's words before this step's arithmetic

    def splits(self, k: int) -> int:
        return -(-k // self.k_per_split)


def int4_gemv_config(n: int, k: int, sms: int) -> Int4Config:
    """The GEMV's tiles for one row, from gpu_quant's H100 sweep: 64 columns, 16 word rows per step, about four
    waves of programs by split-K. Not int4_config's choice (see there); benchmarks and tests ask for it."""
    bn, bk = 64, 128
    return Int4Config(1, bn, bk, split_k(-(-n // bn), k, bk, sms, min_steps=2, waves=4), 4, 1, gemv=True)


def int4_config(m: int, n: int, k: int, group: int, sms: int, offset: bool = False) -> Int4Config:
    """Tiles by batch regime (no autotuning: one compile per regime and shape), from gpu_quant's sweeps on an
    H100 (docs/gpu_quant_*.json): up to SMALL_M rows 16-row tl.dot tiles split along K; then 64- and 128-row
    tiles, split while M <= 64. Every M up to SMALL_M gets the same tiles and split, so a row's bits do not
    depend on how many rows share its step (a token decoded alone, beside others, or in a speculative
    verification); the GEMV (int4_gemv_config) measured ~5% faster at one row but would break that. Steps of one
    group of 32 are too short to stream weights: groups below 64 take `scaled` steps of 64 (128 for narrow
    outputs at small M), which measured 10-25% faster at M = 16 and 64, except in the offset form (`offset`:
    two gathers per weight there made it 1.3-2x slower than one-group steps)."""
    scaled = group < 64 and not offset
    if m <= SMALL_M:
        bm, bn, warps = 16, (128 if n >= 16384 else 64), 4
        bk = (64 if bn == 128 else 128) if scaled else min(group, 128)
    elif m <= 64:
        bm, bn, bk, warps = 64, 64, 64 if scaled else min(group, 64), 4
    else:
        bm, bn, bk, warps = 128, 128, 64 if scaled else min(group, 64), 8
    if scaled and k % bk:
        bk = group   # whole steps: one group always divides K
    tiles = -(-m // bm) * -(-n // bn)
    per_split = split_k(tiles, k, bk, sms) if m <= 64 else k
    return Int4Config(bm, bn, bk, per_split, warps, 3, scaled=scaled)


def _precision(dtype: torch.dtype) -> str:
    """fp32 x stays fp32 (tf32 would round it); bf16/fp16 products with small integers are exact either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit(do_not_specialize=["M"])
def _int4_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, o_ptr, y_ptr, M, N, K, k_per_split, s_xm, s_xk, s_ym, s_yn,
                 GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_OFFSET: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 PRECISION: tl.constexpr, NIBBLE_MAJOR: tl.constexpr, SCALED: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    pid_k = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    mm = rm < M
    nm = rn < N
    rk = tl.arange(0, BK)
    if NIBBLE_MAJOR:   # tile row i * BK/8 + r holds nibble i of word row r, k = 8r + i: x's columns follow
        rk = (rk % (BK // 8)) * 8 + rk // (BK // 8)
    rw = tl.arange(0, BK // 8)
    shifts = tl.arange(0, 8) * 4
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):   # whole steps: BK divides the group (or K, SCALED), the group divides K
        a = tl.load(x_ptr + rm[:, None] * s_xm + (k0 + rk)[None, :] * s_xk, mask=mm[:, None], other=0.0)
        words = tl.load(qw_ptr + ((k0 // 8 + rw) * N)[:, None] + rn[None, :], mask=nm[None, :], other=0)
        if NIBBLE_MAJOR:
            nib = tl.reshape((words[None, :, :] >> shifts[:, None, None]) & 0xF, (BK, BN))
        else:
            nib = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BK, BN))   # row 8r + i
        if SCALED:   # each tile row's group: the step may span groups
            gidx = ((k0 + rk) // GROUP)[:, None] * N + rn[None, :]
            gmask = nm[None, :]
        else:        # one group for the whole step
            gidx = (k0 // GROUP) * N + rn
            gmask = nm
        scale = tl.load(s_ptr + gidx, mask=gmask, other=0.0).to(tl.float32)
        # q - zero as a float without an int-to-float conversion: (q | 0x4B000000) read as fp32 is 2^23 + q.
        if HAS_ZERO:
            base = 8388608.0 + tl.load(z_ptr + gidx, mask=gmask, other=0).to(tl.float32)
            if not SCALED:
                base = base[None, :]
        elif HAS_OFFSET:
            base = 8388608.0
        else:
            base = 8388616.0
        q = (nib | 0x4B000000).to(tl.float32, bitcast=True) - base
        if SCALED:   # the tile dequantised (exact in fp32), then rounded to x's dtype for one dot
            w = q * scale
            if HAS_OFFSET:
                w = w - tl.load(o_ptr + gidx, mask=gmask, other=0.0).to(tl.float32)
            acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION, out_dtype=tl.float32)
        else:
            part = tl.dot(a, q.to(a.dtype), input_precision=PRECISION, out_dtype=tl.float32)
            if HAS_OFFSET:   # s * (x q) - o * (sum of x over the step): the step lies inside one group
                offset = tl.load(o_ptr + gidx, mask=gmask, other=0.0).to(tl.float32)
                xsum = tl.sum(a.to(tl.float32), axis=1)
                acc += part * scale[None, :] - xsum[:, None] * offset[None, :]
            else:
                acc += part * scale[None, :]
    # A K slice writes its own fp32 partial (y is [splits, M, N] then): the host sums them in a fixed order.
    ptrs = y_ptr + pid_k.to(tl.int64) * M * N + rm[:, None] * s_ym + rn[None, :] * s_yn
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["M"])
def _int4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, o_ptr, y_ptr, M, N, K, k_per_split, s_xm, s_xk, s_ym, s_yn,
                      GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_OFFSET: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, PREFETCH: tl.constexpr):
    """Decode rows without tl.dot: a program owns BN columns and a K slice for all BM (<= 4) rows; each step
    loads BKW word rows [BKW, BN] (8 K values per word) and, nibble by nibble, multiplies them into the rows
    on the FMA units. A nibble becomes a float by the exponent trick: (q | 0x4B000000) read as fp32 is 2^23 + q,
    so subtracting (2^23 + zero) gives q - zero exactly in one add (no int-to-float conversion, which runs
    at a quarter of the FMA rate). Per word row the 8 products are summed, then scaled by the word row's
    group scale: all 8 nibbles of a word lie in one group (the group is a multiple of 8). PREFETCH: the next
    step's words are loaded before this step's arithmetic (two loads in flight per program)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    nm = rn < N
    rm = tl.arange(0, BM)
    mm = rm < M
    rw = tl.arange(0, BKW)
    words_total = K // 8
    w_lo = pid_k * (k_per_split // 8)
    w_hi = tl.minimum(w_lo + k_per_split // 8, words_total)
    acc = tl.zeros((BM, BKW, BN), dtype=tl.float32)
    if PREFETCH:
        ahead = tl.load(qw_ptr + (w_lo + rw).to(tl.int64)[:, None] * N + rn[None, :],
                        mask=((w_lo + rw) < w_hi)[:, None] & nm[None, :], other=0)
    for w0 in range(w_lo, w_hi, BKW):
        wr = w0 + rw
        wm = wr < w_hi
        lm = wm[:, None] & nm[None, :]
        if PREFETCH:
            words = ahead
            ahead = tl.load(qw_ptr + (wr + BKW).to(tl.int64)[:, None] * N + rn[None, :],
                            mask=((wr + BKW) < w_hi)[:, None] & nm[None, :], other=0)
        else:
            words = tl.load(qw_ptr + wr.to(tl.int64)[:, None] * N + rn[None, :], mask=lm, other=0)
        g = (wr * 8) // GROUP
        gidx = g[:, None] * N + rn[None, :]
        scale = tl.load(s_ptr + gidx, mask=lm, other=0.0).to(tl.float32)
        if HAS_ZERO:
            base = 8388608.0 + tl.load(z_ptr + gidx, mask=lm, other=0).to(tl.float32)
        elif HAS_OFFSET:
            base = 8388608.0
        else:
            base = 8388616.0   # 2^23 + 8: symmetric
        part = tl.zeros((BM, BKW, BN), dtype=tl.float32)
        xsum = tl.zeros((BM, BKW), dtype=tl.float32)
        for i in tl.static_range(8):
            qf = (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - base
            xi = tl.load(x_ptr + rm[:, None] * s_xm + (wr * 8 + i)[None, :] * s_xk,
                         mask=mm[:, None] & wm[None, :], other=0.0).to(tl.float32)
            part += xi[:, :, None] * qf[None, :, :]
            if HAS_OFFSET:
                xsum += xi
        if HAS_OFFSET:   # s * (x q) - o * (sum of x over the word): as the tiled kernel's offset form
            offset = tl.load(o_ptr + gidx, mask=lm, other=0.0).to(tl.float32)
            acc += part * scale[None, :, :] - xsum[:, :, None] * offset[None, :, :]
        else:
            acc += part * scale[None, :, :]
    y = tl.sum(acc, axis=1)
    ptrs = y_ptr + pid_k.to(tl.int64) * M * N + rm[:, None] * s_ym + rn[None, :] * s_yn
    tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def int4_linear(x: torch.Tensor, w: Int4Packed, config: Int4Config | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32) @ dequant(w)^T -> [..., N] in x's dtype. `config` overrides the tile
    choice (tests force each regime; benchmarks sweep); without Triton (CPU, no interpreter) the reference."""
    check_input(x, w.n, w.k, "int4_linear")
    if not triton_enabled(x.device):
        return int4_linear_reference(x, w)
    x2 = x.reshape(-1, w.k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], w.n)
    cfg = config or int4_config(m, w.n, w.k, w.group, sm_count(x.device), w.has_offset)
    if cfg.gemv:
        bad = cfg.k_per_split % 8 or cfg.block_k % 8
    else:
        bad = cfg.k_per_split % cfg.block_k or (w.k % cfg.block_k if cfg.scaled else w.group % cfg.block_k)
    if bad:
        raise ValueError(f"int4 config {cfg}: block_k must divide the group {w.group} (or K, scaled) and the K "
                         "slice (the GEMV kernel: both multiples of 8)")
    if cfg.gemv and m > cfg.block_m:
        raise ValueError(f"int4 config {cfg}: the GEMV kernel takes at most block_m = {cfg.block_m} rows, got {m}")
    splits = cfg.splits(w.k)
    y = split_output(splits, m, w.n, x)
    args = (x2, w.qweight, w.scale, w.zero if w.zero is not None else w.scale,
            w.offset if w.offset is not None else w.scale, y, m, w.n, w.k,
            cfg.k_per_split, x2.stride(0), x2.stride(1), y.stride(-2), y.stride(-1))
    if cfg.gemv:
        _int4_gemv_kernel[(triton.cdiv(w.n, cfg.block_n), splits)](
            *args, GROUP=w.group, HAS_ZERO=w.has_zero, HAS_OFFSET=w.has_offset, BM=cfg.block_m,
            BN=cfg.block_n, BKW=cfg.block_k // 8, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    else:
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(w.n, cfg.block_n), splits)
        _int4_kernel[grid](*args, GROUP=w.group, HAS_ZERO=w.has_zero, HAS_OFFSET=w.has_offset,
                           BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=8,
                           PRECISION=_precision(x.dtype), NIBBLE_MAJOR=cfg.nibble_major, SCALED=cfg.scaled,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return sum_splits(y, splits, x, w.n)


def int4_linear_reference(x: torch.Tensor, w: Int4Packed | Int4Weight) -> torch.Tensor:
    """The contract: x @ (schemes' fp32 dequantisation)^T in fp32, cast to x's dtype (materialises the weight)."""
    weight = unpack_int4(w) if isinstance(w, Int4Packed) else w
    return F.linear(x.float(), weight.dequantize(torch.float32).to(x.device)).to(x.dtype)
