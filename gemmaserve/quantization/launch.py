"""Where the quantised products run and how their grids are cut: Triton on CUDA, and on the CPU only under
TRITON_INTERPRET=1 (tests); the multiprocessor count; the split-K rule shared by the int4 and fp8 kernels; and
the grouped tile order every tiled GEMM of ours uses (`grouped_tile`, also models/invariant_kernels.py's).

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


def split_k(tiles: int, k: int, block_k: int, sms: int, min_steps: int = 4) -> int:
    """K slices per output tile: about two waves of programs over `sms` multiprocessors, each slice at least
    `min_steps` K steps long (a shorter loop cannot hide its own load latency), never more slices than
    steps. Returns the slice length in elements (a multiple of block_k); the slice count is cdiv(k, length)."""
    steps = -(-k // block_k)
    want = max(1, -(-2 * sms // max(1, tiles)))
    per_slice = max(min_steps, -(-steps // want))
    return min(steps, per_slice) * block_k


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
