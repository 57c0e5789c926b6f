"""LoRA's two products as segment kernels in Triton: the device path of models/lora.py.

    shrink   t[r]  = x[r] A_s(r)^T       A stacked per slot [S, R, in]          t: [splits, rows, R] fp32
    expand   y[r] += t[r] B_s(r)^T       B^T stacked per slot [S, R, out]       y updated in place

s(r) is row r's slot, -1 for a row without an adapter (left untouched), read from an int32 tensor on the
device: the launch shapes depend on the row count and the projection's shape only, never on which rows use
which adapter, so a captured CUDA graph could replay them with the slot tensor rewritten in place. R is the
module's rank allotment (the runner's max rank times the fused parts), each slot zero past its adapter's own
rank: the padding ranks, like B's zero blocks of a fused projection, add exact zeros.

Rows are taken in slot order (`order`, sorted once per forward), so a decode batch of 64 rows over 16
adapters has row blocks of 4 adapters, not 16. Each program owns BLOCK_M rows and one output tile (shrink:
BLOCK_R ranks of one split of the input; expand: BLOCK_N output columns, looping over the rank) and loops over
the distinct slots among its rows: per slot one pass of tl.dot over that slot's weights with the other rows
loaded as zeros, storing that slot's rows only. So a row's arithmetic is the same instructions in the same
order whatever the other rows hold or use (block sizes and the split count depend on the shapes only): its
delta has the same bits alone and in any batch, whichever block it falls in, as invariant_kernels.py's rule.
A prefill block (one sequence) makes one pass; a block holding rows of k adapters makes k.

The shrink cuts `in` into splits of SPLIT_K columns (a fixed size, so a decode batch of a few row blocks still
spreads over the GPU); the expand sums the splits' fp32 partial products in split order, casts t to the
weights' dtype for its tl.dot (as two bf16 products round it), and adds the fp32 delta to y, rounding once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16      # rows per program: tl.dot's smallest tile, so a decode block wastes little on mixed slots
BLOCK_K = 64      # input columns per shrink step
SPLIT_K = 2048    # input columns per shrink program (a multiple of BLOCK_K)
BLOCK_N = 64      # output columns per expand program
MAX_BLOCK_R = 64  # ranks per tile (R above that: more shrink programs, more expand steps)


def _precision(dtype: torch.dtype) -> str:
    """fp32 stays fp32 (tf32 would round the inputs to 10 bits); bf16 products are exact in fp32 either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_r(rank: int) -> int:
    return min(MAX_BLOCK_R, max(16, triton.next_power_of_2(rank)))


def num_splits(in_features: int) -> int:
    return triton.cdiv(in_features, SPLIT_K)


# The row counts change every step, and so does the offset of the order inside the slot-and-order tensor
# (LoRABatch.from_segments): one compiled variant for all of them (no == 1 / % 16 / alignment specialisation),
# so no step compiles a new one in the middle of serving.
_PER_STEP_ARGS = dict(do_not_specialize=["num_rows", "num_slot_rows"],
                      do_not_specialize_on_alignment=["slot_ptr", "order_ptr"])


@triton.jit
def _block_rows(order_ptr, slot_ptr, pid_m, num_rows, num_slot_rows, BLOCK_M: tl.constexpr):
    """The rows of row block `pid_m` (through the slot-sorted order) and their slots (-1: none, or no row)."""
    at = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    live = (at < num_slot_rows) & (at < num_rows)
    rows = tl.load(order_ptr + at, mask=live, other=0).to(tl.int64)
    slots = tl.load(slot_ptr + rows, mask=live & (rows < num_rows), other=-1)
    return rows, slots


@triton.jit(**_PER_STEP_ARGS)
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, order_ptr, t_ptr, num_rows, num_slot_rows, in_features, rank,
                   s_xm, s_xk, s_as, s_ar, s_ak, s_tp, s_tm,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_m, pid_r, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, slots = _block_rows(order_ptr, slot_ptr, pid_m, num_rows, num_slot_rows, BLOCK_M)
    ranks = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < rank
    cols = tl.arange(0, BLOCK_K)
    first = pid_k * SPLIT_K
    width = tl.minimum(SPLIT_K, in_features - first)   # the last split's columns: no steps past `in`
    todo = slots >= 0
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        s = tl.min(tl.where(todo, slots, 2147483647), axis=0)   # the lowest slot not done yet
        mine = slots == s
        a_base = a_ptr + s.to(tl.int64) * s_as
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, width, BLOCK_K):   # the split's columns from its first upward: a fixed order
            k = first + k0 + cols
            k_ok = k < in_features
            x = tl.load(x_ptr + rows[:, None] * s_xm + k[None, :] * s_xk, mask=mine[:, None] & k_ok[None, :],
                        other=0.0)
            a = tl.load(a_base + ranks[:, None] * s_ar + k[None, :] * s_ak, mask=rank_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc += tl.dot(x, tl.trans(a), input_precision=PRECISION)
        tl.store(t_ptr + pid_k * s_tp + rows[:, None] * s_tm + ranks[None, :], acc,
                 mask=mine[:, None] & rank_ok[None, :])
        todo = todo & (slots != s)


@triton.jit(**_PER_STEP_ARGS)
def _expand_kernel(t_ptr, bt_ptr, slot_ptr, order_ptr, y_ptr, num_rows, num_slot_rows, out_features, rank, splits,
                   s_tp, s_tm, s_bs, s_br, s_bn, s_ym, s_yn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows, slots = _block_rows(order_ptr, slot_ptr, pid_m, num_rows, num_slot_rows, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_features
    todo = slots >= 0
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        s = tl.min(tl.where(todo, slots, 2147483647), axis=0)   # the lowest slot not done yet
        mine = slots == s
        b_base = bt_ptr + s.to(tl.int64) * s_bs
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            rank_ok = ranks < rank
            t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for p in range(0, splits):   # the shrink's partial sums, in split order
                t += tl.load(t_ptr + p * s_tp + rows[:, None] * s_tm + ranks[None, :],
                             mask=mine[:, None] & rank_ok[None, :], other=0.0)
            b = tl.load(b_base + ranks[:, None] * s_br + cols[None, :] * s_bn, mask=rank_ok[:, None] & col_ok[None, :],
                        other=0.0)
            acc += tl.dot(t.to(b.dtype), b, input_precision=PRECISION)
        at = y_ptr + rows[:, None] * s_ym + cols[None, :] * s_yn
        keep = mine[:, None] & col_ok[None, :]
        y = tl.load(at, mask=keep, other=0.0)
        tl.store(at, (y.to(tl.float32) + acc).to(y.dtype), mask=keep)
        todo = todo & (slots != s)


def shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Each row's x A_s^T as fp32 partial sums over the input's splits, [splits, rows, R] (rows without a slot,
    and other splits' columns, hold whatever was there: `expand` never reads them)."""
    rows, in_features = x.shape
    num_slots, rank, a_in = a.shape
    if a_in != in_features or x.dtype != a.dtype:
        raise ValueError(f"shrink: x {tuple(x.shape)} {x.dtype} against A {tuple(a.shape)} {a.dtype}")
    splits, block_r = num_splits(in_features), _block_r(rank)
    t = torch.empty(splits, rows, rank, dtype=torch.float32, device=x.device)
    if rows == 0:
        return t
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(rank, block_r), splits)
    _shrink_kernel[grid](x, a, slots, order, t, rows, slots.shape[0], in_features, rank,
                         x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), t.stride(0), t.stride(1),
                         BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K,
                         PRECISION=_precision(x.dtype), num_warps=4)
    return t


def expand(y: torch.Tensor, t: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor,
           order: torch.Tensor) -> torch.Tensor:
    """y[r] += t[r] B_s^T for every row with a slot, in place (`t` from `shrink`, `bt` [S, R, out]); returns y."""
    rows, out_features = y.shape
    splits, t_rows, rank = t.shape
    if bt.shape[1:] != (rank, out_features) or t_rows != rows:
        raise ValueError(f"expand: y {tuple(y.shape)}, t {tuple(t.shape)} against B^T {tuple(bt.shape)}")
    if rows == 0:
        return y
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
    _expand_kernel[grid](t, bt, slots, order, y, rows, slots.shape[0], out_features, rank, splits,
                         t.stride(0), t.stride(1), bt.stride(0), bt.stride(1), bt.stride(2), y.stride(0), y.stride(1),
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=_block_r(rank), PRECISION=_precision(bt.dtype),
                         num_warps=4)
    return y


def slot_order(slots: torch.Tensor) -> torch.Tensor:
    """The rows sorted by slot (stable; rows without one last), int32: the row blocks' membership."""
    key = torch.where(slots >= 0, slots, torch.iinfo(torch.int32).max)
    return torch.argsort(key, stable=True).to(torch.int32)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor,
             order: torch.Tensor | None = None) -> torch.Tensor:
    """y[r] += (x[r] A_s^T) B_s^T for each row r with slot s = slots[r] >= 0 (rows past slots' length have none),
    in place; returns y. x [rows, in], y [rows, out], A [S, R, in], B^T [S, R, out], slots int32. `order`
    (`slot_order(slots)` unless given) groups the rows into blocks: it changes how many passes a block makes,
    never a row's bits."""
    if slots.dtype != torch.int32:
        raise ValueError(f"lora_add: slots must be int32, got {slots.dtype}")
    order = slot_order(slots) if order is None else order
    return expand(y, shrink(x, a, slots, order), bt, slots, order)
