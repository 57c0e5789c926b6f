"""Elementwise work of a Gemma layer, fused on the GPU.

A decode step at small batch is a chain of tiny kernels; unfused, a Gemma 3 layer launched ~70 of
them (each RMSNorm alone is ~7), which cost more than reading the weights. Three Triton kernels cover
the elementwise work of a layer:

* `add_rms_norm(r, x, w_post, w_next)`: r += RMSNorm_post(x); h = RMSNorm_next(r)  (the residual
  add fused with the norm after it, across layer boundaries too);
* `qk_norm_rope(qkv, ...)`: q/k RMSNorm and RoPE for every head of q and k in one launch;
* `gelu_mul(gate_up)`: gelu_tanh(gate) * up.

On the CPU (and whenever Triton cannot run) the same functions run as plain torch ops with HF's exact
order of roundings; on the GPU the kernels compute in fp32 and round once, which differs from HF's
bf16 chain only by bf16 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda


# -- torch reference (the CPU path; HF's roundings) ----------------------------------------------------
def _norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# -- public ops -------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton(x):
        return _triton().rms_norm(x, w, eps)
    return _norm_ref(x, w, eps)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, w_post: torch.Tensor, w_next: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + RMSNorm_post(x), RMSNorm_next(that))."""
    if _use_triton(x):
        return _triton().add_rms_norm(residual, x, w_post, w_next, eps)
    r = residual + _norm_ref(x, w_post, eps)
    return r, _norm_ref(r, w_next, eps)


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, wq: torch.Tensor,
                 wk: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k [T, Hkv, D] (normed, rotated), v [T, Hkv, D] (a view)."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    v = qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim)
    if _use_triton(qkv):
        q, k = _triton().qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, wq, wk, eps, cos, sin)
        return q, k, v
    q, k, _ = qkv.split((q_size, kv_size, kv_size), dim=-1)
    q = _norm_ref(q.view(t, num_heads, head_dim), wq, eps)
    k = _norm_ref(k.view(t, num_kv_heads, head_dim), wk, eps)
    return _rope_ref(q, cos, sin), _rope_ref(k, cos, sin), v


def gelu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    if _use_triton(gate_up):
        return _triton().gelu_mul(gate_up, intermediate)
    gate, up = gate_up.split(intermediate, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _triton():
    from . import fused_kernels

    return fused_kernels
