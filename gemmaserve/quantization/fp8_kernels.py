"""y = x @ w^T over fp8 weights (schemes.Fp8Weight), with x quantised to fp8 at run time as the scheme defines:
the result is dequant(xq) @ dequant(w)^T, not x @ dequant(w)^T, on every device (the CPU reference
quantises activations the same way). y is accumulated in fp32 and returned in `out_dtype` (x's by default).

* per-channel weights: x per token (`quantize_activations_per_token`: scale = amax / 448, a zero row 1); up to
  CHANNEL_TRITON_M rows our Triton kernel below (raw fp8 dot sums, both scale vectors once at the end, split-K),
  beyond it torch._scaled_mm with row-wise scales (scale_a [M, 1], scale_b [1, N], fp32; cuBLASLt, sm89+; K and
  N multiples of 16). Row-wise scaling gives bf16 out; other out dtypes take the tensor-wise call with unit
  scales and fp32 out, then the two scale vectors (same fp32 products, one more elementwise pass).
* block weights (bn x bk, e.g. 128 x 128, DeepSeek-V3 style): x per token per bk-column group
  (`quantize_activations_per_group`, scale [M, ceil(K/bk)]) and our Triton kernel: each K step is one
  bk group, so the fp8 tl.dot's fp32 partial of a step is scaled once by the row's group scale and the
  column's block scale; small M cuts K into slices as well (launch.split_k; fp32 partials summed in a fixed
  order).

Activations are quantised in one Triton launch where Triton runs (the bits of the torch ops that define it
and run elsewhere). Without a fit (CPU without the interpreter, a GPU older than sm89, a per-channel shape
cuBLAS refuses) the reference runs: both operands dequantised in fp32 as the kernels' quantisation defines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import grouped_tile, sm_count, split_k, triton_enabled
from .schemes import FP8_DTYPE, Fp8Weight

FP8_MAX = torch.finfo(FP8_DTYPE).max   # 448
# Per-channel weights at small M go through our kernel, split-K and all: cuBLASLt's row-wise scaled GEMM streams
# the weight at 0.4 of the HBM rate when N is small and K large (the o and down projections; H100, M <= 16).
CHANNEL_TRITON_M = 32
CHANNEL_BK = 128   # the kernel's K step for per-channel weights (no scale changes inside K)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., G] -> fp8 values and fp32 scales [..., 1]: amax / 448 per last-dim row, 1 for a zero row."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still fp32, so that the cast
    after it is exact whatever rounding the cast does (the interpreter's fp8 cast is not round-to-nearest).
    Adding C = 2^(e + 20) (e: v's binade, at least -6) leaves exactly 3 bits of |v|'s mantissa above C's
    last place (2^-9 in the subnormal range); the IEEE add rounds the rest to nearest even."""
    bits = v.to(tl.uint32, bitcast=True)
    mag = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    binade = tl.maximum(((bits >> 23) & 0xFF).to(tl.int32), 127 - 6)
    c = ((binade + 20) << 23).to(tl.float32, bitcast=True)
    rounded = ((mag + c) - c).to(tl.uint32, bitcast=True)
    return (rounded | (bits & 0x80000000)).to(tl.float32, bitcast=True)   # the sign, -0 included


@triton.jit
def _quantize_groups_kernel(x_ptr, xq_ptr, s_ptr, K, s_xm, s_qm, s_sm, GROUP, BLOCK: tl.constexpr,
                            FP8_LIMIT: tl.constexpr):
    """One program per (row, group of columns): the group's amax, then its values scaled, rounded, stored."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lo = g * GROUP
    hi = tl.minimum(lo + GROUP, K)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(lo, hi, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * s_xm + cols, mask=cols < hi, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    peak = tl.max(amax, 0)
    scale = tl.where(peak > 0, tl.math.div_rn(peak, FP8_LIMIT), 1.0)
    tl.store(s_ptr + row * s_sm + g, scale)
    for c0 in range(lo, hi, BLOCK):   # the second read hits L1/L2: a row group is at most a few tens of KB
        cols = c0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * s_xm + cols, mask=cols < hi, other=0.0).to(tl.float32)
        q = _round_e4m3(tl.clamp(tl.math.div_rn(v, scale), -FP8_LIMIT, FP8_LIMIT))
        tl.store(xq_ptr + row * s_qm + cols, q.to(xq_ptr.dtype.element_ty), mask=cols < hi)


def quantize_activations_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_quantize_groups` in torch ops (the definition; the CPU's path, and the kernel's reference)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x, (0, groups * group - k)) if k % group else x   # zeros change no amax
    xq, scale = _quantize_rows(padded.reshape(m, groups, group))
    return xq.reshape(m, groups * group)[:, :k].contiguous(), scale.reshape(m, groups)


def _quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], fp32 scales [M, ceil(K/group)]): torch ops, or one Triton launch where
    Triton runs (the same bits: IEEE division, round to nearest even)."""
    m, k = x.shape
    groups = -(-k // group)
    if not triton_enabled(x.device) or m == 0:
        return quantize_activations_torch(x, group)
    if x.stride(1) != 1:
        x = x.contiguous()
    xq = torch.empty(m, k, device=x.device, dtype=FP8_DTYPE)
    scale = torch.empty(m, groups, device=x.device, dtype=torch.float32)
    block = min(1024, triton.next_power_of_2(min(group, k)))
    _quantize_groups_kernel[(m, groups)](x, xq, scale, k, x.stride(0), xq.stride(0), scale.stride(0), group,
                                         BLOCK=block, FP8_LIMIT=FP8_MAX, num_warps=4)
    return xq, scale


def quantize_activations_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq fp8 e4m3 [M, K], scale fp32 [M, 1]) with x ~ float(xq) * scale."""
    return _quantize_groups(x, x.shape[1])


def quantize_activations_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq fp8 [M, K], scale fp32 [M, ceil(K/group)]): one scale per token per `group` columns
    (the last group may be short)."""
    return _quantize_groups(x, group)


def dequantize_activations(xq: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """fp32 x from either activation quantisation: scale [M, 1] (per token, group None) or [M, ceil(K/group)]."""
    k = xq.shape[1]
    group = group or k
    return xq.float() * scale.repeat_interleave(group, dim=1)[:, :k]


@dataclass(frozen=True)
class BlockConfig:
    block_m: int
    block_n: int
    k_per_split: int   # a multiple of the weight's bk (one scale per K step)
    num_warps: int
    num_stages: int


def block_config(m: int, n: int, k: int, bk: int, sms: int) -> BlockConfig:
    """Decode: 16-row tiles, split-K to fill the GPU; larger M: 64/128-row tiles, split only up to M = 64."""
    if m <= 16:
        bm, bn, warps, stages = 16, 64, 4, 4
    elif m <= 64:
        bm, bn, warps, stages = 64, 64, 4, 4
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
    tiles = -(-m // bm) * -(-n // bn)
    return BlockConfig(bm, bn, split_k(tiles, k, bk, sms) if m <= 64 else -(-k // bk) * bk, warps, stages)


@triton.jit(do_not_specialize=["M"])
def _fp8_block_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, y_ptr, M, N, K, k_per_split,
                      s_xm, s_xsm, s_wn, s_wsn, s_ym,
                      BN_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """Block weights: each step's fp32 dot partial times the row's group scale and the column's block scale.
    PER_CHANNEL (xs [M, 1], ws [N]): the raw partials are summed and both scale vectors applied once at the end,
    as the scaled GEMM defines (the same products, rounded in another order than cuBLASLt's)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BM, BN, GROUP_M)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mm = rm < M
    nm = rn < N
    rk = tl.arange(0, BK)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):   # one step = one bk group of x and one block column of w
        kk = k0 + rk
        km = kk < K
        a = tl.load(xq_ptr + rm[:, None] * s_xm + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        b = tl.load(wq_ptr + rn[None, :] * s_wn + kk[:, None], mask=km[:, None] & nm[None, :], other=0.0)
        if UPCAST:   # the interpreter has no fp8 dot; fp8 products are exact in fp32 either way
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        part = tl.dot(a, b, out_dtype=tl.float32)
        if PER_CHANNEL:
            acc += part
        else:
            g = k0 // BK
            xs = tl.load(xs_ptr + rm * s_xsm + g, mask=mm, other=0.0)
            ws = tl.load(ws_ptr + (rn // BN_SCALE) * s_wsn + g, mask=nm, other=0.0)
            acc += part * xs[:, None] * ws[None, :]
    if PER_CHANNEL:
        xs = tl.load(xs_ptr + rm * s_xsm, mask=mm, other=0.0)
        ws = tl.load(ws_ptr + rn, mask=nm, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    # A K slice writes its own fp32 partial (y is [splits, M, N] then): the host sums them in a fixed order.
    ptrs = y_ptr + pid_k.to(tl.int64) * M * N + rm[:, None] * s_ym + rn[None, :]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def fp8_block_matmul(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype,
                     config: BlockConfig | None = None) -> torch.Tensor:
    """dequant(xq, xs) @ dequant(w)^T for block weights, or per-channel ones (xs per token, K steps of
    CHANNEL_BK), through the Triton kernel (CUDA or interpreter)."""
    m, k = xq.shape
    n = w.q.shape[0]
    bn, bk = w.block or (1, CHANNEL_BK)
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"fp8 block kernel: the weight's block width {bk} is not a power of two >= 16")
    cfg = config or block_config(m, n, k, bk, sm_count(xq.device))
    if cfg.k_per_split % bk:
        raise ValueError(f"fp8 block config {cfg}: k_per_split must be a multiple of the block width {bk}")
    splits = -(-k // cfg.k_per_split)
    if m == 0:
        return torch.empty(0, n, device=xq.device, dtype=out_dtype)
    # Split K: one fp32 partial per slice, summed below in a fixed order (deterministic, unlike atomics).
    y = torch.empty(splits, m, n, device=xq.device, dtype=torch.float32) if splits > 1 else \
        torch.empty(m, n, device=xq.device, dtype=out_dtype)
    xs = xs.contiguous()
    ws = w.scale.float().contiguous()
    if w.block is None:
        ws = ws.reshape(n, 1)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), splits)
    _fp8_block_kernel[grid](xq, xs, w.q, ws, y, m, n, k, cfg.k_per_split, xq.stride(0), xs.stride(0),
                            w.q.stride(0), ws.stride(0), y.stride(-2), BN_SCALE=bn, BM=cfg.block_m,
                            BN=cfg.block_n, BK=bk, GROUP_M=8, UPCAST=xq.device.type != "cuda",
                            PER_CHANNEL=w.block is None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return (y.sum(0) if splits > 1 else y).to(out_dtype)


def _fp8_capable(device: torch.device) -> bool:
    """fp8 tensor cores (cuBLASLt fp8, Triton's fp8 dot): sm89 and newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype | None = None,
               config: BlockConfig | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in out_dtype (x's dtype by default): activations quantised per token (per
    channel weights) or per token and bk group (block weights), then the fp8 product (module docstring)."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: input {tuple(x.shape)} has K = {x.shape[-1]}, the weight [N={n}, K={k}] "
                         f"expects K = {k}")
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, k)
    if w.block is not None:
        xq, xs = quantize_activations_per_group(x2, w.block[1])
        if _fp8_capable(x.device) or (x.device.type == "cpu" and triton_enabled(x.device)):
            y = fp8_block_matmul(xq, xs, w, out_dtype, config)
        else:
            y = _reference_product(xq, xs, w, out_dtype)
        return y.view(*x.shape[:-1], n)
    xq, xs = quantize_activations_per_token(x2)
    if (_fp8_capable(x.device) and x2.shape[0] <= CHANNEL_TRITON_M) or config is not None:
        return fp8_block_matmul(xq, xs, w, out_dtype, config).view(*x.shape[:-1], n)
    if not _fp8_capable(x.device) or k % 16 or n % 16:   # cuBLASLt's fp8 needs K and N multiples of 16
        return _reference_product(xq, xs, w, out_dtype).view(*x.shape[:-1], n)
    ws = w.scale.float().reshape(1, n)
    if out_dtype == torch.bfloat16:
        y = torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
    else:   # row-wise scaling is bf16-out only: tensor-wise unit scales, fp32 out, then both scale vectors
        one = torch.ones((), device=x.device, dtype=torch.float32)
        y = (torch._scaled_mm(xq, w.q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32) * xs * ws)
        y = y.to(out_dtype)
    return y.view(*x.shape[:-1], n)


def _reference_product(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    x = dequantize_activations(xq, xs, None if w.block is None else w.block[1])
    return F.linear(x, w.dequantize(torch.float32).to(xq.device)).to(out_dtype)


def fp8_linear_reference(x: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The contract in fp32: the same activation quantisation as `fp8_linear`, both operands dequantised."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    xq, xs = (quantize_activations_per_group(x2, w.block[1]) if w.block is not None
              else quantize_activations_per_token(x2))
    return _reference_product(xq, xs, w, out_dtype or x.dtype).view(*x.shape[:-1], n)
