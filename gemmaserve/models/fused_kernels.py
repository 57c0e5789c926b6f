"""Triton kernels behind `fused_ops` (fp32 math, one rounding to the activation dtype per output)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, s_x, s_y, N: tl.constexpr, BLOCK: tl.constexpr, eps):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(x_ptr + row * s_x + c, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    tl.store(y_ptr + row * s_y + c, (x * inv * (1.0 + w)).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _add_rms_norm_kernel(r_ptr, x_ptr, wp_ptr, wn_ptr, r_out_ptr, y_ptr, s_r, s_x, s_ro, s_y,
                         N: tl.constexpr, BLOCK: tl.constexpr, eps):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(x_ptr + row * s_x + c, mask=m, other=0.0).to(tl.float32)
    wp = tl.load(wp_ptr + c, mask=m, other=0.0).to(tl.float32)
    n = (x * tl.rsqrt(tl.sum(x * x, 0) / N + eps) * (1.0 + wp)).to(r_out_ptr.dtype.element_ty)
    r = (tl.load(r_ptr + row * s_r + c, mask=m, other=0.0).to(tl.float32) + n.to(tl.float32)).to(
        r_out_ptr.dtype.element_ty)
    tl.store(r_out_ptr + row * s_ro + c, r, mask=m)
    rf = r.to(tl.float32)
    wn = tl.load(wn_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_y + c, (rf * tl.rsqrt(tl.sum(rf * rf, 0) / N + eps) * (1.0 + wn)).to(
        y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, s_t, s_ct, s_qt, s_kt,
                         HQ: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, eps):
    t = tl.program_id(0)
    h = tl.program_id(1)           # 0..HQ-1: query heads, HQ..: key heads
    i = tl.arange(0, HALF)
    base = qkv_ptr + t * s_t + h * D
    x1 = tl.load(base + i).to(tl.float32)
    x2 = tl.load(base + HALF + i).to(tl.float32)
    is_q = h < HQ
    w1 = tl.where(is_q, tl.load(wq_ptr + i), tl.load(wk_ptr + i)).to(tl.float32)
    w2 = tl.where(is_q, tl.load(wq_ptr + HALF + i), tl.load(wk_ptr + HALF + i)).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
    # Round the normed value to the activation dtype, as the unfused model does before RoPE.
    n1 = (x1 * inv * (1.0 + w1)).to(q_ptr.dtype.element_ty).to(tl.float32)
    n2 = (x2 * inv * (1.0 + w2)).to(q_ptr.dtype.element_ty).to(tl.float32)
    cos1 = tl.load(cos_ptr + t * s_ct + i).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * s_ct + i).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * s_ct + HALF + i).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * s_ct + HALF + i).to(tl.float32)
    o1 = (n1 * cos1 - n2 * sin1).to(q_ptr.dtype.element_ty)
    o2 = (n2 * cos2 + n1 * sin2).to(q_ptr.dtype.element_ty)
    if is_q:
        dst = q_ptr + t * s_qt + h * D
    else:
        dst = k_ptr + t * s_kt + (h - HQ) * D
    tl.store(dst + i, o1)
    tl.store(dst + HALF + i, o2)


@triton.jit
def _gelu_mul_kernel(gu_ptr, out_ptr, s_g, s_o, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    c = blk * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    g = tl.load(gu_ptr + row * s_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * s_g + I + c, mask=m, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    # tanh(z) = 1 - 2 / (exp(2z) + 1), stable for large |z|
    th = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    tl.store(out_ptr + row * s_o + c, (0.5 * g * (1.0 + th) * u).to(out_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    y = torch.empty_like(x2)
    n = x2.shape[1]
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, w, y, x2.stride(0), y.stride(0), N=n, BLOCK=triton.next_power_of_2(n),
                                         eps=eps, num_warps=8 if n >= 2048 else 4)
    return y.view_as(x)


def add_rms_norm(residual, x, w_post, w_next, eps):
    r2, x2 = _rows(residual), _rows(x)
    r_out = torch.empty_like(r2)
    y = torch.empty_like(x2)
    n = x2.shape[1]
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](r2, x2, w_post, w_next, r_out, y, r2.stride(0), x2.stride(0),
                                             r_out.stride(0), y.stride(0), N=n, BLOCK=triton.next_power_of_2(n),
                                             eps=eps, num_warps=8 if n >= 2048 else 4)
    return r_out.view_as(residual), y.view_as(x)


def qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, wq, wk, eps, cos, sin):
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    k = torch.empty(t, num_kv_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    if t:
        assert qkv.stride(1) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride()
        _qk_norm_rope_kernel[(t, num_heads + num_kv_heads)](
            qkv, wq, wk, cos, sin, q, k, qkv.stride(0), cos.stride(0), q.stride(0), k.stride(0),
            HQ=num_heads, D=head_dim, HALF=head_dim // 2, eps=eps)
    return q, k


def gelu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    g2 = _rows(gate_up)
    out = torch.empty(g2.shape[0], intermediate, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    if g2.shape[0]:
        _gelu_mul_kernel[(g2.shape[0], triton.cdiv(intermediate, block))](g2, out, g2.stride(0), out.stride(0),
                                                                        I=intermediate, BLOCK=block)
    return out.view(*gate_up.shape[:-1], intermediate)
