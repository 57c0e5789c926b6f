"""Triton kernels behind `fused_ops` (fp32 math, one rounding to the activation dtype per output)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, s_x, s_y, N: tl.constexpr, BLOCK: tl.constexpr, eps, offset,
                     HAS_W: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(x_ptr + row * s_x + c, mask=m, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    if HAS_W:
        y = y * (offset + tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32))
    tl.store(y_ptr + row * s_y + c, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _add_rms_norm_kernel(r_ptr, x_ptr, wp_ptr, wn_ptr, scale_ptr, r_out_ptr, y_ptr, s_r, s_x, s_ro, s_y,
                         N: tl.constexpr, BLOCK: tl.constexpr, eps, offset, HAS_NEXT: tl.constexpr,
                         HAS_SCALE: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(x_ptr + row * s_x + c, mask=m, other=0.0).to(tl.float32)
    wp = tl.load(wp_ptr + c, mask=m, other=0.0).to(tl.float32)
    n = (x * tl.rsqrt(tl.sum(x * x, 0) / N + eps) * (offset + wp)).to(r_out_ptr.dtype.element_ty)
    r = (tl.load(r_ptr + row * s_r + c, mask=m, other=0.0).to(tl.float32) + n.to(tl.float32)).to(
        r_out_ptr.dtype.element_ty)
    if HAS_SCALE:   # Gemma 4's layer scalar: a second rounding, as HF's `hidden_states *= layer_scalar`
        r = (r.to(tl.float32) * tl.load(scale_ptr).to(tl.float32)).to(r_out_ptr.dtype.element_ty)
    tl.store(r_out_ptr + row * s_ro + c, r, mask=m)
    if HAS_NEXT:
        rf = r.to(tl.float32)
        wn = tl.load(wn_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * s_y + c, (rf * tl.rsqrt(tl.sum(rf * rf, 0) / N + eps) * (offset + wn)).to(
            y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _qkv_norm_rope_kernel(qkv_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
                          s_t, s_ct, s_qt, s_kt, s_vt, eps, offset,
                          HQ: tl.constexpr, HK: tl.constexpr, Q_SIZE: tl.constexpr, V_OFF: tl.constexpr,
                          D: tl.constexpr, HALF: tl.constexpr):
    """Program (t, h): h < HQ a query head, then HK key heads (normed + rotated), then value heads
    (weightless norm, no rotation) read from column V_OFF on (the raw k columns when K = V)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, HALF)
    base = qkv_ptr + t * s_t
    is_q = h < HQ
    is_v = h >= HQ + HK
    if is_q:
        src = base + h * D
        dst = q_ptr + t * s_qt + h * D
        w_ptr = wq_ptr
    elif is_v:
        src = base + V_OFF + (h - HQ - HK) * D
        dst = v_ptr + t * s_vt + (h - HQ - HK) * D
        w_ptr = wq_ptr   # not read
    else:
        src = base + Q_SIZE + (h - HQ) * D
        dst = k_ptr + t * s_kt + (h - HQ) * D
        w_ptr = wk_ptr
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
    w1 = tl.where(is_v, 1.0, tl.load(w_ptr + i).to(tl.float32) + offset)
    w2 = tl.where(is_v, 1.0, tl.load(w_ptr + HALF + i).to(tl.float32) + offset)
    # Round the normed value to the activation dtype, as the unfused model does before RoPE.
    n1 = (x1 * inv * w1).to(q_ptr.dtype.element_ty).to(tl.float32)
    n2 = (x2 * inv * w2).to(q_ptr.dtype.element_ty).to(tl.float32)
    cos1 = tl.where(is_v, 1.0, tl.load(cos_ptr + t * s_ct + i).to(tl.float32))
    sin1 = tl.where(is_v, 0.0, tl.load(sin_ptr + t * s_ct + i).to(tl.float32))
    cos2 = tl.where(is_v, 1.0, tl.load(cos_ptr + t * s_ct + HALF + i).to(tl.float32))
    sin2 = tl.where(is_v, 0.0, tl.load(sin_ptr + t * s_ct + HALF + i).to(tl.float32))
    tl.store(dst + i, (n1 * cos1 - n2 * sin1).to(q_ptr.dtype.element_ty))
    tl.store(dst + HALF + i, (n2 * cos2 + n1 * sin2).to(q_ptr.dtype.element_ty))


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
    """x as rows [R, N] with unit stride along N (the kernels take a row stride only). reshape keeps
    a transposed input strided when it can: [1, N, M].transpose(1, 2) comes back with stride N."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] <= 1 else x2.contiguous()


def _warps(n: int) -> int:
    return 8 if n >= 2048 else 4


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, kind) -> torch.Tensor:
    x2 = _rows(x)
    y = torch.empty_like(x2)
    n = x2.shape[1]
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2 if w is None else w, y, x2.stride(0), y.stride(0), N=n,
                                         BLOCK=triton.next_power_of_2(n), eps=kind.eps, offset=kind.offset,
                                         HAS_W=w is not None, num_warps=_warps(n))
    return y.view_as(x)


def add_rms_norm(residual, x, w_post, w_next, kind, scale=None):
    r2, x2 = _rows(residual), _rows(x)
    r_out = torch.empty_like(r2)
    y = torch.empty_like(x2) if w_next is not None else r_out
    n = x2.shape[1]
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](
            r2, x2, w_post, w_post if w_next is None else w_next, w_post if scale is None else scale, r_out, y,
            r2.stride(0), x2.stride(0), r_out.stride(0), y.stride(0), N=n, BLOCK=triton.next_power_of_2(n),
            eps=kind.eps, offset=kind.offset, HAS_NEXT=w_next is not None, HAS_SCALE=scale is not None,
            num_warps=_warps(n))
    return r_out.view_as(residual), (y.view_as(x) if w_next is not None else None)


def qkv_norm_rope(qkv, p, wq, wk, cos, sin):
    t = qkv.shape[0]
    hq, hkv, d = p.num_heads, p.num_kv_heads, p.head_dim
    q = torch.empty(t, hq, d, device=qkv.device, dtype=qkv.dtype)
    hk = hkv if p.owns_kv else 0
    k = torch.empty(t, hkv, d, device=qkv.device, dtype=qkv.dtype) if hk else None
    hv = hkv if p.owns_kv and p.value_norm else 0
    v = torch.empty(t, hkv, d, device=qkv.device, dtype=qkv.dtype) if hv else None
    v_off = p.q_size if p.k_eq_v else p.q_size + p.kv_size
    if t:
        assert qkv.stride(1) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride()
        _qkv_norm_rope_kernel[(t, hq + hk + hv)](
            qkv, wq, wq if wk is None else wk, cos, sin, q, q if k is None else k, q if v is None else v,
            qkv.stride(0), cos.stride(0), q.stride(0), k.stride(0) if k is not None else 0,
            v.stride(0) if v is not None else 0, p.norm.eps, p.norm.offset,
            HQ=hq, HK=hk, Q_SIZE=p.q_size, V_OFF=v_off, D=d, HALF=d // 2)
    if p.owns_kv and v is None:   # Gemma 3: v is the raw projection, a view of qkv
        v = qkv[:, v_off:v_off + p.kv_size].view(t, hkv, d)
    return q, k, v


def gelu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    g2 = _rows(gate_up)
    out = torch.empty(g2.shape[0], intermediate, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    if g2.shape[0]:
        _gelu_mul_kernel[(g2.shape[0], triton.cdiv(intermediate, block))](g2, out, g2.stride(0), out.stride(0),
                                                                        I=intermediate, BLOCK=block)
    return out.view(*gate_up.shape[:-1], intermediate)
