"""Batch-invariant matmuls for `--batch-invariant` (CUDA; on the CPU only under TRITON_INTERPRET=1, for tests).

A row of y = x W^T is K products summed in some order. cuBLAS picks its kernel (tile shape, split-K,
stream-K) from the whole problem's shape, M included, so the same row gets other bits in a batch of 1
than in a batch of 37. Here a row's sum never depends on M:

* one tile configuration per (N, K, dtype) (`gemm_config`), never per M, no autotuning;
* each program owns one BM x BN output tile and walks K from 0 upward in steps of BK, accumulating
  tl.dot's fp32 partial products in that order; no split-K, no atomics, one rounding to the output dtype;
* rows the tile does not own are loaded as zeros and never stored: an output element's arithmetic is
  the same instruction sequence whatever the other rows hold and wherever in its tile the row falls.

So every row of the output has the same bits for any M and any row position. The cost is a fixed tile
for every batch size: a decode step's few rows fill a 64-row tile, and large prefills get no
M-specific tuning (measured in the GPU benchmark, `gpu_bench invariant`).

`grouped_matmul` is the same loop for Gemma 4's experts: rows sorted by expert, each tile takes rows of one
expert only (tiles are cut per expert on the device, no host sync), so a row's sum depends on its own
values and expert, never on how many rows other experts got.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..quantization.launch import expert_tile, expert_tiles, grouped_tile


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemm_config(n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """The one tile configuration for x [M, k] @ W^T [k, n] in `dtype`, for every M (no M parameter on
    purpose). 64 rows per tile; 64 columns (128 for wide outputs such as the LM head) so that a decode
    step of a narrow layer still spreads over many programs (no split-K to do that instead)."""
    del k   # one BK for every K: the reduction is the same loop, only its length differs
    wide = n >= 16384
    if dtype == torch.float32:   # fp32 tiles are twice the bytes: a shorter K step keeps stages in shared memory
        return GemmConfig(64, 128 if wide else 64, 32, 4, 3)
    return GemmConfig(64, 128 if wide else 64, 64, 4, 3)


def _precision(dtype: torch.dtype) -> str:
    """fp32 stays fp32 (tf32 would round the inputs); bf16 products are exact in fp32 either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


# M is the batch's row count: one compiled variant for every M (no ==1 / %16 specialisation).
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, s_xm, s_xk, s_wn, s_wk, s_ym, s_yn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)   # which program computes a tile
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    mm = rm < M
    nm = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):   # the fixed reduction order: K blocks from 0 upward
        kk = k0 + rk
        km = kk < K
        a = tl.load(x_ptr + rm[:, None] * s_xm + kk[None, :] * s_xk, mask=mm[:, None] & km[None, :], other=0.0)
        b = tl.load(w_ptr + kk[:, None] * s_wk + rn[None, :] * s_wn, mask=km[:, None] & nm[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype, each row's bits independent of the others."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m:
        cfg = gemm_config(n, k, weight.dtype)
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        _matmul_kernel[grid](x2, weight, y, m, n, k, x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
                             y.stride(0), y.stride(1), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=8,
                             PRECISION=_precision(weight.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.view(*x.shape[:-1], n)


@triton.jit(do_not_specialize=["M"])
def _grouped_matmul_kernel(x_ptr, w_ptr, y_ptr, row_ends_ptr, tile_ends_ptr, M, N, K,
                           s_xm, s_xk, s_we, s_wk, s_wn, s_ym, s_yn,
                           E: tl.constexpr, E_BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, PRECISION: tl.constexpr):
    e, rm, mm = expert_tile(tl.program_id(0), row_ends_ptr, tile_ends_ptr, E, E_BLOCK, BM)
    if e < E:   # else: a program past the last tile (the grid is an upper bound)
        pid_n = tl.program_id(1)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK)
        nm = rn < N
        w_e = w_ptr + e.to(tl.int64) * s_we
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            km = kk < K
            a = tl.load(x_ptr + rm[:, None] * s_xm + kk[None, :] * s_xk, mask=mm[:, None] & km[None, :], other=0.0)
            b = tl.load(w_e + kk[:, None] * s_wk + rn[None, :] * s_wn, mask=km[:, None] & nm[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, row_ends: torch.Tensor) -> torch.Tensor:
    """Rows of x [M, K] sorted by expert (expert e owns rows [row_ends[e-1], row_ends[e])) times that
    expert's w[e] ([E, K, N], any strides) -> [M, N]; the semantics of torch._grouped_mm(x, w, offs=row_ends).
    Nothing is read back to the host (a CUDA graph can capture it)."""
    m, k = x.shape
    e, _, n = w.shape
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    cfg = gemm_config(n, k, w.dtype)
    tile_ends, tiles = expert_tiles(row_ends, m, cfg.block_m)
    _grouped_matmul_kernel[(tiles, triton.cdiv(n, cfg.block_n))](
        x, w, y, row_ends.to(torch.int32), tile_ends, m, n, k, x.stride(0), x.stride(1),
        w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1), E=e,
        E_BLOCK=max(16, triton.next_power_of_2(e)), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        PRECISION=_precision(w.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
