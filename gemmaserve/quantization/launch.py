"""Where the quantised products run and how their grids are cut: Triton on CUDA, and on the CPU only under
TRITON_INTERPRET=1 (tests); the multiprocessor count; the split-K rule shared by the int4 and fp8 kernels; and
the grouped tile order every tiled GEMM of ours uses (`grouped_tile`, also models/invariant_kernels.py's); and how
a grouped (per-expert) GEMM cuts rows sorted by expert into tiles on the device (`expert_tiles`, `expert_tile`).

A small-batch product over quantised weights is a stream of weight bytes: its time is the bytes over the HBM
bandwidth only if enough programs are reading at once. A tile of output columns is one program's work; when
N alone gives too few tiles to fill the GPU, K is cut into `split` slices as well: each slice writes its fp32
partial sums, and the partials are added in a fixed order afterwards (atomic adds would let the order, hence the
bits, vary from run to run).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def triton_enabled(device: torch.device) -> bool:
    """Our Triton kernels run on CUDA, and on the CPU only in Triton's interpreter (tests)."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (torch caches the properties); 8 off CUDA, for the interpreter."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k(tiles: int, k: int, block_k: int, sms: int, min_steps: int = 4, waves: int = 2) -> int:
    """K slices per output tile: about `waves` waves of programs over `sms` multiprocessors, each slice at least
    `min_steps` K steps long (a shorter loop cannot hide its own load latency), never more slices than
    steps. Returns the slice length in elements (a multiple of block_k); the slice count is cdiv(k, length)."""
    steps = -(-k // block_k)
    want = max(1, -(-waves * sms // max(1, tiles)))
    per_slice = max(min_steps, -(-steps // want))
    return min(steps, per_slice) * block_k


def check_input(x: torch.Tensor, n: int, k: int, what: str) -> None:
    """A weight-only product's input: K columns, a float dtype the kernels take."""
    if x.shape[-1] != k:
        raise ValueError(f"{what}: input {tuple(x.shape)} has K = {x.shape[-1]}, the weight [N={n}, K={k}] "
                         f"expects K = {k}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: input dtype {x.dtype}, expected bf16, fp16 or fp32")


def split_output(splits: int, m: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """Where a launch writes: one fp32 partial per K slice ([splits, M, N], summed by `sum_splits` in a fixed order:
    atomics would let the bits, hence a greedy token, vary from run to run), or y itself when K is not split."""
    if splits > 1:
        return torch.empty(splits, m, n, device=like.device, dtype=torch.float32)
    return torch.empty(m, n, device=like.device, dtype=like.dtype)


def sum_splits(y: torch.Tensor, splits: int, x: torch.Tensor, n: int) -> torch.Tensor:
    """`split_output`'s partials summed in slice order, as x's dtype with x's leading dims."""
    if splits > 1:
        y = y.sum(0)
    return y.to(x.dtype).view(*x.shape[:-1], n)


@triton.jit
def grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program `pid`'s output tile (row tile, column tile) in grouped order: GROUP_M row tiles in turn take one
    column tile, so its weights are read from L2 by all of them. Which program computes a tile, never how."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


def expert_tiles(row_ends: torch.Tensor, m: int, block_m: int) -> tuple[torch.Tensor, int]:
    """`m` rows sorted by expert (expert e owns rows [row_ends[e-1], row_ends[e])) cut into tiles of `block_m` rows
    of one expert each: the running count of tiles by expert (int32 [E], computed on the device: nothing is read
    back, so a CUDA graph can capture it) and the grid's row-tile count, an upper bound known from the shapes alone
    (each expert adds at most one partial tile, and every tile holds a row)."""
    counts = torch.diff(row_ends.long(), prepend=row_ends.new_zeros(1).long())
    tile_ends = torch.cumsum(torch.div(counts + block_m - 1, block_m, rounding_mode="floor"), 0).to(torch.int32)
    return tile_ends, min(triton.cdiv(m, block_m) + row_ends.numel(), m)


@triton.jit
def expert_tile(tile, row_ends_ptr, tile_ends_ptr, E: tl.constexpr, E_BLOCK: tl.constexpr, BM: tl.constexpr):
    """Row tile `tile` of a grouped GEMM: (its expert e, its rows [BM] as int64, their mask). e == E for a program
    past the last tile (the grid is an upper bound): then no row is in the mask."""
    experts = tl.arange(0, E_BLOCK)
    tile_ends = tl.load(tile_ends_ptr + experts, mask=experts < E, other=2147483647)
    e = tl.sum((tile_ends <= tile).to(tl.int32), 0)   # the expert whose tiles hold this one
    first_tile = tl.load(tile_ends_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    row_begin = tl.load(row_ends_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    row_end = tl.load(row_ends_ptr + e, mask=e < E, other=0)
    rm = (row_begin + (tile - first_tile) * BM + tl.arange(0, BM)).to(tl.int64)
    return e, rm, rm < row_end
