"""Grouped products over quantised MoE experts: y[i] = x[i] @ dequant(w[e(i)])^T for rows x sorted by expert (expert e
owns rows [row_ends[e-1], row_ends[e])), every expert in one launch, as models/moe.py's grouped matmuls are for bf16
experts. Triton on CUDA (and on the CPU under TRITON_INTERPRET=1), the fp32 references elsewhere; y in x's dtype (or
`out_dtype`), accumulated in fp32.

The weights (`QuantExperts`): one of schemes.py's weights over the experts' rows stacked, [E * N, K] (expert e's
output rows at [e N, (e + 1) N)), so that each scheme is still defined once:

    FP8 per channel   q fp8 e4m3 [E, N, K], scale fp32 [E, N]: one scale per (expert, output channel); activations
                      quantised per token at run time, as fp8_kernels.quantize_activations_per_token does (the
                      scheme: y = dequant(xq) @ dequant(w)^T)
    INT4 groups       q [E, N, K], scale [E, N, K/g], zero points or offsets likewise (schemes.Int4Weight's forms:
                      symmetric, zero points, the offset form of GGUF's Q4_K / Q4_1)

The int4 kernel reads `Int4ExpertsPacked`: int4_kernels.Int4Packed with a leading expert dim (qweight int32
[E, K/8, N], scale [E, K/g, N], zero uint8 / offset float [E, K/g, N]), each expert packed by `pack_int4`.

Tiles map to experts as models/invariant_kernels.py's grouped GEMM does (launch.expert_tiles / expert_tile): the
rows of each expert are cut into BM-row tiles on the device (a running count of tiles per expert), the grid is an
upper bound on the tiles known from the shapes alone, and a program past the last tile does nothing. No count is
read back to the host and no atomics are used: a CUDA graph can capture a launch and the same input gives the same
bits on every run. No split-K: a decode step's rows already spread over top-k experts times the column tiles.

    fp8   each K step is an fp8 tl.dot (fp32 upcast in the interpreter, which has no fp8 dot: the products are exact
          in fp32 either way) summed raw; the row's activation scale and the column's weight scale multiply once at
          the end, as the per-channel scaled GEMM defines.
    int4  each K step lies inside one group (BK divides g): the nibbles become q - zero (or q, offset form) in fp32
          by the exponent trick (int4_kernels.py), are multiplied by x's tile with tl.dot (exact products) and the
          partial is scaled by the group's scale; the offset form subtracts the offset times the step's sum of x.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .fp8_kernels import _fp8_capable, dequantize_activations, quantize_activations_per_token, \
    quantize_activations_torch
from .int4_kernels import Int4Packed, check_geometry, pack_int4, unpack_int4
from .launch import expert_tile, expert_tiles, triton_enabled
from .schemes import Fp8Weight, Int4Weight, quantize_fp8_per_channel

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class QuantExperts:
    """E experts' weights [E, N, K] as one schemes.py weight over their stacked rows [E * N, K] (fp8 per channel, or
    int4 groups in any of their forms)."""

    weight: Int4Weight | Fp8Weight
    num_experts: int

    def __post_init__(self) -> None:
        rows = self.weight.shape[0]
        if self.num_experts <= 0 or rows % self.num_experts:
            raise ValueError(f"{rows} weight rows do not split into {self.num_experts} experts")
        if isinstance(self.weight, Fp8Weight) and self.weight.block is not None:
            raise ValueError("fp8 experts are per output channel (block scales are not supported for experts)")

    @property
    def shape(self) -> tuple[int, int, int]:
        rows, k = self.weight.shape
        return self.num_experts, rows // self.num_experts, k

    @property
    def is_fp8(self) -> bool:
        return isinstance(self.weight, Fp8Weight)

    def expert(self, e: int) -> Int4Weight | Fp8Weight:
        """Expert e's weight [N, K] (views of the stacked tensors)."""
        n = self.shape[1]
        rows = slice(e * n, (e + 1) * n)
        w = self.weight
        if isinstance(w, Fp8Weight):
            return Fp8Weight(w.q[rows], w.scale[rows])
        pick = lambda t: None if t is None else t[rows]   # noqa: E731
        return Int4Weight(w.q[rows], w.scale[rows], pick(w.zero), w.group, pick(w.offset))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E, N, K] in `dtype` (schemes' fp32 dequantisation, then cast)."""
        return self.weight.dequantize(dtype).view(self.shape)

    def to(self, device: torch.device | str) -> "QuantExperts":
        w = self.weight
        if isinstance(w, Fp8Weight):
            return QuantExperts(Fp8Weight(w.q.to(device), w.scale.to(device)), self.num_experts)
        return QuantExperts(w.to(device), self.num_experts)


def quantize_fp8_experts(w: torch.Tensor, amax: torch.Tensor | None = None) -> QuantExperts:
    """Float experts [E, N, K] to fp8 with one fp32 scale per (expert, output channel), as `--quantization fp8` does
    for projections (schemes.quantize_fp8_per_channel over the stacked rows). `amax` [E, N]: the rows' amax where `w`
    holds only some of each row's columns (a tensor-parallel rank's slice)."""
    e, n, k = w.shape
    return QuantExperts(quantize_fp8_per_channel(w.reshape(e * n, k), None if amax is None else amax.reshape(e * n)), e)


# -- the int4 kernel's layout --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Int4ExpertsPacked:
    qweight: torch.Tensor          # int32 [E, K/8, N]
    scale: torch.Tensor            # [E, K/g, N], float (as saved)
    zero: torch.Tensor | None      # uint8 [E, K/g, N], or None (symmetric, or the offset form)
    offset: torch.Tensor | None    # float [E, K/g, N]: w = s q - offset, or None
    num_experts: int
    n: int
    k: int
    group: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.num_experts, self.n, self.k

    def expert(self, e: int) -> Int4Packed:
        pick = lambda t: None if t is None else t[e]   # noqa: E731
        return Int4Packed(self.qweight[e], self.scale[e], pick(self.zero), self.n, self.k, self.group,
                          pick(self.offset))



def pack_int4_experts(w: QuantExperts) -> Int4ExpertsPacked:
    """Int4 experts in the kernel's layout (each expert as int4_kernels.pack_int4 packs it), on w's device."""
    if w.is_fp8:
        raise ValueError("pack_int4_experts takes int4 experts")
    e, n, k = w.shape
    check_geometry(n, k, w.weight.group)
    packed = [pack_int4(w.expert(i)) for i in range(e)]
    stack = lambda ts: None if ts[0] is None else torch.stack(ts)   # noqa: E731
    return Int4ExpertsPacked(stack([p.qweight for p in packed]), stack([p.scale for p in packed]),
                             stack([p.zero for p in packed]), stack([p.offset for p in packed]), e, n, k,
                             w.weight.group)


def unpack_int4_experts(p: Int4ExpertsPacked) -> QuantExperts:
    """The int4 experts `p` packs (exactly)."""
    parts = [unpack_int4(p.expert(e)) for e in range(p.num_experts)]
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)   # noqa: E731
    return QuantExperts(Int4Weight(cat([w.q for w in parts]), cat([w.scale for w in parts]),
                                   cat([w.zero for w in parts]), p.group, cat([w.offset for w in parts])),
                        p.num_experts)


# -- tiles ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupedConfig:
    block_m: int
    block_n: int
    block_k: int       # int4: divides the group; fp8: any power of two >= 16 (K is masked)
    num_warps: int
    num_stages: int


def grouped_config(m: int, num_experts: int, group: int | None) -> GroupedConfig:
    """Tiles by the rows per expert (no autotuning): a decode step's few rows per expert take 16-row tiles, larger
    batches 64. `group`: the int4 group (None: fp8)."""
    bk = 128 if group is None else min(group, 64)
    if m <= 4 * num_experts:
        return GroupedConfig(16, 64, bk, 4, 3)
    return GroupedConfig(64, 128 if group is None else 64, bk, 4, 3)


def _check_rows(x: torch.Tensor, k: int, row_ends: torch.Tensor, num_experts: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{what}: input {tuple(x.shape)}, expected [M, {k}]")
    if row_ends.numel() != num_experts:
        raise ValueError(f"{what}: {row_ends.numel()} row ends for {num_experts} experts")


# -- FP8 -----------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _fp8_grouped_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, y_ptr, row_ends_ptr, tile_ends_ptr, M, N, K, s_xm, s_ym,
                        E: tl.constexpr, E_BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, UPCAST: tl.constexpr):
    e, rm, mm = expert_tile(tl.program_id(0), row_ends_ptr, tile_ends_ptr, E, E_BLOCK, BM)
    if e < E:   # else: a program past the last tile (the grid is an upper bound)
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        nm = rn < N
        rk = tl.arange(0, BK)
        w_e = wq_ptr + e.to(tl.int64) * N * K
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            km = kk < K
            a = tl.load(xq_ptr + rm[:, None] * s_xm + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            b = tl.load(w_e + rn[None, :] * K + kk[:, None], mask=km[:, None] & nm[None, :], other=0.0)
            if UPCAST:   # the interpreter has no fp8 dot; fp8 products are exact in fp32 either way
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(a, b, out_dtype=tl.float32)
        xs = tl.load(xs_ptr + rm, mask=mm, other=0.0)
        ws = tl.load(ws_ptr + e.to(tl.int64) * N + rn, mask=nm, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
        tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])


def fp8_grouped_matmul(xq: torch.Tensor, xs: torch.Tensor, w: QuantExperts, row_ends: torch.Tensor,
                       out_dtype: torch.dtype, config: GroupedConfig | None = None) -> torch.Tensor:
    """dequant(xq, xs) @ dequant(w[e])^T for rows sorted by expert (xs [M, 1] per token), through the Triton kernel
    (CUDA or the interpreter)."""
    e, n, k = w.shape
    m = xq.shape[0]
    y = torch.empty(m, n, device=xq.device, dtype=out_dtype)
    if m == 0:
        return y
    cfg = config or grouped_config(m, e, None)
    tile_ends, tiles = expert_tiles(row_ends, m, cfg.block_m)
    xq = xq.contiguous()
    _fp8_grouped_kernel[(tiles, triton.cdiv(n, cfg.block_n))](
        xq, xs.contiguous(), w.weight.q, w.weight.scale.float().contiguous(), y, row_ends.to(torch.int32), tile_ends,
        m, n, k, xq.stride(0), y.stride(0), E=e, E_BLOCK=max(16, triton.next_power_of_2(e)), BM=cfg.block_m,
        BN=cfg.block_n, BK=cfg.block_k, UPCAST=xq.device.type != "cuda", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


def fp8_grouped_linear(x: torch.Tensor, w: QuantExperts, row_ends: torch.Tensor, out_dtype: torch.dtype | None = None,
                       config: GroupedConfig | None = None) -> torch.Tensor:
    """x [M, K] sorted by expert -> [M, N] in out_dtype (x's by default): x quantised per token, then the grouped fp8
    product (the kernel where it runs: sm89+ CUDA or the interpreter; else the reference)."""
    e, n, k = w.shape
    _check_rows(x, k, row_ends, e, "fp8_grouped_linear")
    out_dtype = out_dtype or x.dtype
    xq, xs = quantize_activations_per_token(x)
    if _fp8_capable(x.device) or (x.device.type == "cpu" and triton_enabled(x.device)):
        return fp8_grouped_matmul(xq, xs, w, row_ends, out_dtype, config)
    return _grouped_reference(dequantize_activations(xq, xs), w, row_ends, F.linear).to(out_dtype)


# -- INT4 ----------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _int4_grouped_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, o_ptr, y_ptr, row_ends_ptr, tile_ends_ptr, M, N, K,
                         s_xm, s_xk, s_ym, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_OFFSET: tl.constexpr,
                         E: tl.constexpr, E_BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, PRECISION: tl.constexpr):
    e, rm, mm = expert_tile(tl.program_id(0), row_ends_ptr, tile_ends_ptr, E, E_BLOCK, BM)
    if e < E:   # else: a program past the last tile (the grid is an upper bound)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = rn < N
        rk = tl.arange(0, BK)
        rw = tl.arange(0, BK // 8)
        shifts = tl.arange(0, 8) * 4
        e64 = e.to(tl.int64)
        qw_e = qw_ptr + e64 * (K // 8) * N
        g_off = e64 * (K // GROUP) * N   # expert e's scales (zero points, offsets) start here
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):   # whole steps inside one group: BK divides the group, the group divides K
            a = tl.load(x_ptr + rm[:, None] * s_xm + (k0 + rk)[None, :] * s_xk, mask=mm[:, None], other=0.0)
            words = tl.load(qw_e + ((k0 // 8 + rw) * N)[:, None] + rn[None, :], mask=nm[None, :], other=0)
            nib = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BK, BN))   # row 8r + i
            gidx = g_off + (k0 // GROUP) * N + rn
            scale = tl.load(s_ptr + gidx, mask=nm, other=0.0).to(tl.float32)
            # q - zero as a float without an int-to-float conversion: (q | 0x4B000000) read as fp32 is 2^23 + q.
            if HAS_ZERO:
                base = (8388608.0 + tl.load(z_ptr + gidx, mask=nm, other=0).to(tl.float32))[None, :]
            elif HAS_OFFSET:
                base = 8388608.0
            else:
                base = 8388616.0   # 2^23 + 8: symmetric
            q = (nib | 0x4B000000).to(tl.float32, bitcast=True) - base
            part = tl.dot(a, q.to(a.dtype), input_precision=PRECISION, out_dtype=tl.float32)
            if HAS_OFFSET:   # s * (x q) - o * (sum of x over the step): the step lies inside one group
                offset = tl.load(o_ptr + gidx, mask=nm, other=0.0).to(tl.float32)
                acc += part * scale[None, :] - tl.sum(a.to(tl.float32), axis=1)[:, None] * offset[None, :]
            else:
                acc += part * scale[None, :]
        tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])


def int4_grouped_linear(x: torch.Tensor, w: Int4ExpertsPacked, row_ends: torch.Tensor,
                        config: GroupedConfig | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) sorted by expert -> x @ dequant(w[e])^T [M, N] in x's dtype; without Triton
    (the CPU without the interpreter) the reference."""
    e, n, k = w.shape
    _check_rows(x, k, row_ends, e, "int4_grouped_linear")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"int4_grouped_linear: input dtype {x.dtype}, expected bf16, fp16 or fp32")
    if not triton_enabled(x.device):
        return _grouped_reference(x, unpack_int4_experts(w), row_ends, F.linear)
    m = x.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    cfg = config or grouped_config(m, e, w.group)
    if w.group % cfg.block_k or cfg.block_k % 16:
        raise ValueError(f"int4 grouped config {cfg}: block_k must divide the group {w.group} and be a multiple of 16")
    tile_ends, tiles = expert_tiles(row_ends, m, cfg.block_m)
    _int4_grouped_kernel[(tiles, triton.cdiv(n, cfg.block_n))](
        x, w.qweight, w.scale, w.zero if w.zero is not None else w.scale, w.offset if w.offset is not None else w.scale,
        y, row_ends.to(torch.int32), tile_ends, m, n, k, x.stride(0), x.stride(1), y.stride(0), GROUP=w.group,
        HAS_ZERO=w.zero is not None, HAS_OFFSET=w.offset is not None, E=e, E_BLOCK=max(16, triton.next_power_of_2(e)),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


# -- the references ------------------------------------------------------------------------------------------------
def _grouped_reference(x: torch.Tensor, w: QuantExperts, row_ends: torch.Tensor, matmul: Matmul) -> torch.Tensor:
    """fp32 x's rows of each expert times that expert's fp32 dequantised weight (one expert dequantised at a time, only
    those with rows), by `matmul`; reads the row ends back to the host."""
    x = x.float()
    y = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(row_ends.tolist()):
        if end > start:
            y[start:end] = matmul(x[start:end], w.expert(e).dequantize(torch.float32).to(x.device))
        start = end
    return y


def grouped_reference(x: torch.Tensor, w: QuantExperts, row_ends: torch.Tensor, out_dtype: torch.dtype | None = None,
                      matmul: Matmul = F.linear) -> torch.Tensor:
    """The contract in fp32, then cast to out_dtype (x's by default): fp8 experts quantise x per token first (as
    `fp8_grouped_linear`, by the torch ops that define it), int4 ones multiply x itself. `matmul`: the fp32 product
    (the CPU's row-invariant one in a model: a row's result then does not depend on its batch)."""
    out_dtype = out_dtype or x.dtype
    if w.is_fp8:
        x = dequantize_activations(*quantize_activations_torch(x, x.shape[1]))
    return _grouped_reference(x, w, row_ends, matmul).to(out_dtype)

