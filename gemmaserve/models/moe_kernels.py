"""Gemma 4's experts for a few decode tokens in two launches (moe.py's `Experts` takes this path on the GPU).

The grouped path sorts the (token, expert) pairs by expert, gathers rows, runs two grouped matmuls sized for
prefill, unsorts and sums: about ten launches a layer, and matmul tiles of 64+ rows for one row per expert. At
decode each pair is one row, so here every pair reads its own expert's weights directly (the router's expert ids
stay on the device: nothing is sorted, counted or read back):

    gate_up   grid (pairs, I / BN): h[p] = gelu_tanh(x[t] . W_gate[e]) * (x[t] . W_up[e]), e = idx[p], t = p / k
    down      grid (tokens, H / BN): y[t] = sum over j = 0..k-1, in that order, of w[t, j] * (h[t k + j] . W_down[e])

Products accumulate in fp32 and are rounded to the activations' dtype where the grouped path rounds them (its
matmuls' outputs), so the values are that path's up to summation order. A token's programs read only its own
rows, so its bits do not depend on the other tokens of the batch; `--batch-invariant` keeps the grouped GEMM
(prefill chunks must give the same bits as decode there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quantization.launch import triton_enabled

MAX_PAIRS = 64   # (token, expert) pairs a step may take here: 8 tokens of top-8 (beyond that experts repeat)


@triton.jit
def _gate_up_kernel(x_ptr, idx_ptr, w_ptr, h_ptr, s_x, s_we, s_wn, s_h, H: tl.constexpr, I: tl.constexpr,
                    TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pair = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = rn < I
    e = tl.load(idx_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * s_x
    gate_rows = w_ptr + e * s_we + rn[:, None].to(tl.int64) * s_wn
    up_rows = gate_rows + I * s_wn
    acc_g = tl.zeros((BN,), dtype=tl.float32)
    acc_u = tl.zeros((BN,), dtype=tl.float32)
    for k0 in tl.static_range(0, H, BK):   # unrolled: the loads of every step may issue before the sums
        rk = k0 + tl.arange(0, BK)
        km = rk < H
        x = tl.load(x_row + rk, mask=km, other=0.0).to(tl.float32)[None, :]
        wm = nm[:, None] & km[None, :]
        acc_g += tl.sum(tl.load(gate_rows + rk[None, :], mask=wm, other=0.0).to(tl.float32) * x, axis=1)
        acc_u += tl.sum(tl.load(up_rows + rk[None, :], mask=wm, other=0.0).to(tl.float32) * x, axis=1)
    # rounded as the grouped matmul's output, then gelu_mul's arithmetic (fused_kernels._gelu_mul_kernel)
    g = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    th = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    tl.store(h_ptr + pair.to(tl.int64) * s_h + rn, (0.5 * g * (1.0 + th) * u).to(h_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _down_kernel(h_ptr, idx_ptr, wgt_ptr, w_ptr, y_ptr, s_h, s_we, s_wn, s_y, H: tl.constexpr, I: tl.constexpr,
                 TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = rn < H
    total = tl.zeros((BN,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):   # a token's k outputs summed in index order
        pair = t * TOP_K + j
        e = tl.load(idx_ptr + pair).to(tl.int64)
        rows = w_ptr + e * s_we + rn[:, None].to(tl.int64) * s_wn
        h_row = h_ptr + pair.to(tl.int64) * s_h
        acc = tl.zeros((BN,), dtype=tl.float32)
        for k0 in tl.static_range(0, I, BK):
            rk = k0 + tl.arange(0, BK)
            km = rk < I
            h = tl.load(h_row + rk, mask=km, other=0.0).to(tl.float32)[None, :]
            acc += tl.sum(tl.load(rows + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32) * h,
                          axis=1)
        total += acc.to(y_ptr.dtype.element_ty).to(tl.float32) * tl.load(wgt_ptr + pair)
    tl.store(y_ptr + t.to(tl.int64) * s_y + rn, total.to(y_ptr.dtype.element_ty), mask=nm)


def decode_eligible(x: torch.Tensor, idx: torch.Tensor) -> bool:
    """A few tokens' rows (at most MAX_PAIRS pairs) where our Triton kernels run."""
    return triton_enabled(x.device) and 0 < idx.numel() <= MAX_PAIRS and x.dim() == 2


def experts_decode(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, intermediate: int) -> torch.Tensor:
    """x [T, H] (the experts' input rows), weights [T, k] fp32 and idx [T, k] (the router's), gate_up
    [E, 2I, H] ([gate; up] rows) and down [E, H, I] as Experts holds them -> [T, H] in x's dtype."""
    t, k = idx.shape
    h_dim = x.shape[1]
    if gate_up.shape[1:] != (2 * intermediate, h_dim) or down.shape[1:] != (h_dim, intermediate):
        raise ValueError(f"experts_decode: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not fit "
                         f"H = {h_dim}, I = {intermediate}")
    if gate_up.stride(-1) != 1 or down.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("experts_decode: weights and rows need unit stride along K")
    idx = idx.contiguous()
    weights = weights.to(torch.float32).contiguous()
    h = torch.empty(t * k, intermediate, device=x.device, dtype=x.dtype)
    y = torch.empty(t, h_dim, device=x.device, dtype=x.dtype)
    bn, bk = 16, 256
    _gate_up_kernel[(t * k, triton.cdiv(intermediate, bn))](
        x, idx, gate_up, h, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0), H=h_dim, I=intermediate,
        TOP_K=k, BN=bn, BK=bk, num_warps=4)
    _down_kernel[(t, triton.cdiv(h_dim, bn))](
        h, idx, weights, down, y, h.stride(0), down.stride(0), down.stride(1), y.stride(0), H=h_dim, I=intermediate,
        TOP_K=k, BN=bn, BK=bk, num_warps=4)
    return y
