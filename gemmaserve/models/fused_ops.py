"""Elementwise work of a Gemma layer, fused on the GPU.

A decode step at small batch is a chain of tiny kernels; unfused, a Gemma layer launched ~70 of
them (each RMSNorm alone is ~7), which cost more than reading the weights. Triton kernels cover the
elementwise work of a layer:

* `add_rms_norm(r, x, w_post, w_next)`: r += RMSNorm_post(x) (then r *= scale, Gemma 4's layer
  scalar); h = RMSNorm_next(r): the residual add fused with the norm after it, across layers too;
* `qkv_norm_rope(qkv, ...)`: q/k RMSNorm and RoPE, and Gemma 4's weightless value norm, for every
  head of one layer in one launch (K = V layers read the raw k columns for v; layers that read
  another layer's KV have only q columns);
* `gelu_mul(gate_up)`: gelu_tanh(gate) * up.

Norm flavour is a parameter (`NormKind`: Gemma 3's (1 + w), Gemma 4's w; no weight at all for the
value and router norms). On the GPU the kernels compute in fp32 and round once, which differs from HF's
bf16 chain only by bf16 rounding.

On the CPU the norms and gelu_mul are custom ops (`gemmaserve::rms_norm`, `add_rms_norm`, `gelu_mul`)
that eager steps and compiled graphs both call (a graph's own fused versions sum and round in other
orders: a compiled step would not give an eager step's bits). Their Python kernels are the torch ops
below (HF's order of roundings); models/cpu_kernels.py gives them C++ kernels, the norms with roundings
of their own (one pass per row), gelu_mul with the same ATen calls. Each computes a row by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .layers import AttentionParams


@dataclass(frozen=True)
class NormKind:
    """y = x * (mean(x^2) + eps)^-1/2 * (offset + w): offset 1 for Gemma 3, 0 for Gemma 4."""

    eps: float
    offset: float


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def _on_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu"


# -- torch reference (the CPU path; HF's roundings) ----------------------------------------------------
def _norm_ref(x: torch.Tensor, w: torch.Tensor | None, kind: NormKind) -> torch.Tensor:
    if x.dtype == torch.float32 and w is not None and kind.offset != 0.0:
        # The same ops in the same order inside one aten call (bit-identical in fp32, checked in tests):
        # the decode step runs ~110 of these norms, so the per-op dispatch matters on the CPU.
        return F.rms_norm(x, (x.shape[-1],), kind.offset + w.float(), kind.eps)
    h = x.float()
    if kind.offset == 0.0:   # Gemma 4 writes it as pow(-0.5) (matching JAX) and multiplies by w itself
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + kind.eps, -0.5)
        return (h if w is None else h * w.float()).type_as(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + kind.eps)
    return (h if w is None else h * (kind.offset + w.float())).type_as(x)


@torch.library.custom_op("gemmaserve::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, w: torch.Tensor | None, eps: float, offset: float) -> torch.Tensor:
    return _norm_ref(x, w, NormKind(eps, offset))


@_rms_norm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor | None, eps: float, offset: float) -> torch.Tensor:
    return torch.empty_like(x)


def _gelu_mul_ref(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """gelu_tanh(gate) * up, gelu one row at a time: the CPU kernel runs a vector body and scalar code
    for what is left over, which round differently, and where the leftovers fall follows the tensor's
    size and how it is split among threads (a [175, 96] gate: row 87's last 16 values), never the row."""
    gate, up = gate_up.split(intermediate, dim=-1)
    rows = gate.reshape(-1, intermediate)
    out = torch.empty(rows.shape, dtype=gate.dtype, device=gate.device)
    for i in range(rows.shape[0]):
        out[i] = F.gelu(rows[i], approximate="tanh")
    return out.view(gate.shape) * up


@torch.library.custom_op("gemmaserve::gelu_mul", mutates_args=())
def _gelu_mul_op(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    return _gelu_mul_ref(gate_up, intermediate)


@_gelu_mul_op.register_fake
def _(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] - intermediate)


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# -- public ops -------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor | None, kind: NormKind) -> torch.Tensor:
    """RMSNorm over the last dim; `w` None: no weight (Gemma 4's value and router norms)."""
    if _use_triton(x):
        return _triton().rms_norm(x, w, kind)
    if _on_cpu(x):
        return torch.ops.gemmaserve.rms_norm(x, w, kind.eps, kind.offset)
    return _norm_ref(x, w, kind)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, w_post: torch.Tensor, w_next: torch.Tensor | None,
                 kind: NormKind, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """r = residual + RMSNorm_post(x), then r *= scale (a 1-element tensor) if given; returns
    (r, RMSNorm_next(r)), or (r, None) without `w_next`."""
    if _use_triton(x):
        return _triton().add_rms_norm(residual, x, w_post, w_next, kind, scale)
    if _on_cpu(x):   # one op (one call from a compiled graph, ~10 us each)
        r, h = torch.ops.gemmaserve.add_rms_norm(residual, x, w_post, w_next, kind.eps, kind.offset, scale)
        return r, (None if w_next is None else h)
    return _add_rms_norm_ref(residual, x, w_post, w_next, kind, scale)


def _add_rms_norm_ref(residual: torch.Tensor, x: torch.Tensor, w_post: torch.Tensor, w_next: torch.Tensor | None,
                      kind: NormKind, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    r = residual + rms_norm(x, w_post, kind)
    if scale is not None:
        r = r * scale
    return r, (None if w_next is None else rms_norm(r, w_next, kind))


@torch.library.custom_op("gemmaserve::add_rms_norm", mutates_args=())
def _add_rms_norm_op(residual: torch.Tensor, x: torch.Tensor, w_post: torch.Tensor, w_next: torch.Tensor | None,
                     eps: float, offset: float, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    r, h = _add_rms_norm_ref(residual, x, w_post, w_next, NormKind(eps, offset), scale)
    return r, (r.new_empty(0) if h is None else h)


@_add_rms_norm_op.register_fake
def _(residual: torch.Tensor, x: torch.Tensor, w_post: torch.Tensor, w_next: torch.Tensor | None, eps: float,
      offset: float, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(residual), (residual.new_empty(0) if w_next is None else torch.empty_like(residual))


def qkv_norm_rope(qkv: torch.Tensor, p: "AttentionParams", wq: torch.Tensor, wk: torch.Tensor | None,
                  cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """qkv [T, sum(p.qkv_sizes)] -> q [T, Hq, D] (normed, rotated), k [T, Hkv, D] (normed, rotated) and
    v [T, Hkv, D] (value-normed if p.value_norm; a view of qkv otherwise). k and v are None for a
    layer that reads another layer's KV."""
    t = qkv.shape[0]
    hq, hkv, d = p.num_heads, p.num_kv_heads, p.head_dim
    if _use_triton(qkv):
        return _triton().qkv_norm_rope(qkv, p, wq, wk, cos, sin)
    parts = qkv.split(p.qkv_sizes, dim=-1)
    q = _rope_ref(rms_norm(parts[0].view(t, hq, d), wq, p.norm), cos, sin)
    if not p.owns_kv:
        return q, None, None
    k_raw = parts[1].view(t, hkv, d)
    k = _rope_ref(rms_norm(k_raw, wk, p.norm), cos, sin)
    v = k_raw if p.k_eq_v else parts[2].view(t, hkv, d)
    if p.value_norm:
        v = rms_norm(v, None, p.norm)
    return q, k, v


def gelu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    if _use_triton(gate_up):
        return _triton().gelu_mul(gate_up, intermediate)
    if _on_cpu(gate_up):
        return torch.ops.gemmaserve.gelu_mul(gate_up, intermediate)
    return _gelu_mul_ref(gate_up, intermediate)


def _triton():
    from . import fused_kernels

    return fused_kernels
