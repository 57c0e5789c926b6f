"""Building blocks shared by the Gemma models (numerics as in ../shared/reference/gemma-architecture.md).

What differs between Gemma 3 and Gemma 4 is a parameter here, never a copy:

    norm flavour   Gemma 3: x * rsqrt(ms + eps) * (1 + w)     Gemma 4: ... * w   (offset 1 / 0)
    attention      scale (qpas^-1/2 or 1), head dim and KV heads per layer, value norm, K = V,
                   layers that read another layer's KV and project no K/V of their own
    RoPE           default, linear (positions / factor), proportional (Gemma 4 full layers)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import BatchAttention
from ..errors import UserInputError
from .fused_ops import NormKind, gelu_mul, qkv_norm_rope

if TYPE_CHECKING:
    from .lora import LoRABatch


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * (offset + w), in fp32, cast back after the multiply.
    Gemma 3 stores zero-centred weights (offset 1), Gemma 4 plain ones (offset 0)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, offset: float = 1.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset, dtype=dtype), requires_grad=False)

    @property
    def kind(self) -> NormKind:
        return NormKind(self.eps, self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .fused_ops import rms_norm

        return rms_norm(x, self.weight, self.kind)


# The Python kernels' fallback (no C++ library): BLAS products padded to whole tiles of 4 rows. On some
# BLAS builds (MKL on AVX2 and AVX-512 AMD hosts) a row of a full tile comes out the same whatever the
# row count; on others (MKL on an AMX Xeon) it does not, which the start-up check reports
# (cpu_kernels.check_batch_invariance).
ROW_TILE = 4


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for x of shape [T, in]; on the CPU each row's result independent of the others, in
    the products' own summation order (cpu_products.py; an op that a compiled graph calls as it is)."""
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight)
    return torch.ops.gemmaserve.linear(x, weight)


def _padded_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    m = x.shape[0]
    if m % ROW_TILE == 0:
        return F.linear(x, weight)
    return F.linear(torch.cat([x, x.new_zeros(ROW_TILE - m % ROW_TILE, x.shape[1])]), weight)[:m]


@torch.library.custom_op("gemmaserve::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _padded_linear(x, weight)


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T through the batch-invariant Triton GEMM (invariant_kernels.py): each row's bits do
    not depend on the other rows (`--batch-invariant`)."""
    from .invariant_kernels import matmul

    return matmul(x, weight)


class Linear(nn.Module):
    """y = x W^T with no bias; weights are filled by the loader (no random init). `batch_invariant`
    (set by the engine, batch_invariant.py) routes it through the batch-invariant GEMM."""

    batch_invariant = False

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight) if self.batch_invariant else linear(x, self.weight)


def project(module: nn.Module, x: torch.Tensor, lora: "LoRABatch | None") -> torch.Tensor:
    """module(x), plus its LoRA deltas for the rows of a batch that has adapters (models/lora.py). A
    row-parallel module under tensor parallelism adds its rank's share of the delta before the sum over ranks."""
    if lora is None:
        return module(x)
    partial = getattr(module, "partial", None)
    if partial is not None:
        return module.reduce(lora.add(module, x, partial(x)))
    return lora.add(module, x, module(x))


class Embedding(nn.Module):
    """A token embedding table; `as_head` is the tied output projection (logits = h E^T). Filled by
    the loader; `quant.QuantEmbedding` is the INT8 form with the same interface."""

    batch_invariant = False   # the output head through the batch-invariant GEMM (as `Linear`)

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return invariant_linear(hidden, self.weight) if self.batch_invariant else linear(hidden, self.weight)


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)); gate and up are one fused matrix [gate; up]."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, dtype)
        self.down_proj = Linear(intermediate, hidden, dtype)

    def forward(self, x: torch.Tensor, lora: "LoRABatch | None" = None) -> torch.Tensor:
        return project(self.down_proj, gelu_mul(project(self.gate_up_proj, x, lora), self.intermediate), lora)


class RopeKind(enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"              # inv_freq / factor
    PROPORTIONAL = "proportional"  # Gemma 4 full layers: the first partial * D/2 frequencies, the rest 0


@dataclass(frozen=True)
class RopeParams:
    """NeoX-layout ("rotate_half") rotary embedding of one layer type.

    Proportional RoPE keeps the denominator of the full head dim and zero-pads the table, so dims
    [0, n) and [D/2, D/2 + n) rotate as pairs (i, i + D/2) and the rest pass through (cos 1, sin 0):
    the same tables and kernels serve every kind.
    """

    theta: float
    factor: float = 1.0
    kind: RopeKind = RopeKind.DEFAULT
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind is RopeKind.DEFAULT and self.factor != 1.0:
            object.__setattr__(self, "kind", RopeKind.LINEAR)   # RopeParams(theta, factor) means linear
        if self.theta <= 0 or self.factor <= 0:
            raise UserInputError(f"RoPE theta and factor must be positive, got {self.theta}, {self.factor}")
        if not 0.0 <= self.partial_rotary_factor <= 1.0:
            raise UserInputError(f"partial_rotary_factor must be in [0, 1], got {self.partial_rotary_factor}")

    @classmethod
    def from_hf(cls, params: dict, where: str) -> "RopeParams":
        """From one entry of a transformers `rope_parameters` dict."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", 10_000.0))
        if rope_type == "default":
            return cls(theta)
        if rope_type == "linear":
            return cls(theta, float(params["factor"]), RopeKind.LINEAR)
        if rope_type == "proportional":
            return cls(theta, float(params.get("factor", 1.0)), RopeKind.PROPORTIONAL,
                       float(params.get("partial_rotary_factor", 1.0)))
        raise UserInputError(f"unsupported RoPE type {rope_type!r} on {where} (supported: default, linear, "
                             "proportional)")

    def to_hf(self) -> dict:
        out: dict = {"rope_type": self.kind.value, "rope_theta": self.theta}
        if self.kind is RopeKind.LINEAR or self.factor != 1.0:
            out["factor"] = self.factor
        if self.kind is RopeKind.PROPORTIONAL:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        return out

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """[D/2] fp32 inverse frequencies, as transformers computes them."""
        if self.kind is RopeKind.PROPORTIONAL:
            rotated = int(self.partial_rotary_factor * head_dim // 2)
            exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim
            freq = torch.cat((1.0 / (self.theta ** exponents), torch.zeros(head_dim // 2 - rotated)))
            return freq / self.factor
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (self.theta ** exponents) / self.factor

    @staticmethod
    def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, D], computed in fp32 and cast to the activation dtype. (On the CPU an
        op a compiled graph calls as it is: its own cos and sin round differently.)"""
        if positions.device.type == "cpu":
            cos, sin = torch.ops.gemmaserve.rope_tables(positions, inv_freq)
        else:
            cos, sin = _rope_tables(positions, inv_freq)
        return cos.to(dtype), sin.to(dtype)


def _rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


@torch.library.custom_op("gemmaserve::rope_tables", mutates_args=())
def _rope_tables_op(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_tables(positions, inv_freq)


@_rope_tables_op.register_fake
def _(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (positions.shape[0], 2 * inv_freq.shape[0])
    return inv_freq.new_empty(shape), inv_freq.new_empty(shape)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's final logit soft-capping); an op on the CPU, as `cos_sin`."""
    if x.device.type == "cpu":
        return torch.ops.gemmaserve.softcap(x, cap)
    return _softcap(x, cap)


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


@torch.library.custom_op("gemmaserve::softcap", mutates_args=())
def _softcap_op(x: torch.Tensor, cap: float) -> torch.Tensor:
    return _softcap(x, cap)


@_softcap_op.register_fake
def _(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.empty_like(x)


@dataclass(frozen=True)
class AttentionParams:
    """One attention layer's shape and numerics, derived from the model config."""

    layer: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int | None            # sliding window (keys > q - W), None for full attention
    norm: NormKind                # q/k norms (weighted)
    value_norm: bool = False      # Gemma 4: weightless RMSNorm over v
    k_eq_v: bool = False          # V = v_norm(raw k_proj output); the layer has no v_proj
    owns_kv: bool = True          # False: reads its KV source's cache, projects only q
    image_bidirectional: bool = False   # tokens of one image see each other (the batch says where images are)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_sizes(self) -> tuple[int, ...]:
        """Rows of each part of qkv_proj: (q, k, v), (q, k) with K = V, (q,) without own KV."""
        if not self.owns_kv:
            return (self.q_size,)
        if self.k_eq_v:
            return (self.q_size, self.kv_size)
        return (self.q_size, self.kv_size, self.kv_size)


class Attention(nn.Module):
    """Projections, q/k (and v) norms and RoPE, then the batch's attention, then o_proj."""

    def __init__(self, p: AttentionParams, dtype: torch.dtype):
        super().__init__()
        self.p = p
        self.qkv_proj = Linear(p.hidden_size, sum(p.qkv_sizes), dtype)
        self.o_proj = Linear(p.q_size, p.hidden_size, dtype)
        self.q_norm = RMSNorm(p.head_dim, p.norm.eps, dtype, p.norm.offset)
        self.k_norm = RMSNorm(p.head_dim, p.norm.eps, dtype, p.norm.offset) if p.owns_kv else None

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                attn: BatchAttention, lora: "LoRABatch | None" = None) -> torch.Tensor:
        p = self.p
        q, k, v = qkv_norm_rope(project(self.qkv_proj, x, lora), p, self.q_norm.weight,
                                self.k_norm.weight if self.k_norm is not None else None, *cos_sin)
        if p.image_bidirectional:
            o = attn(p.layer, q, k, v, scale=p.scale, window=p.window, bidirectional=True)
        else:   # text layers call every backend the same way as before images existed
            o = attn(p.layer, q, k, v, scale=p.scale, window=p.window)
        return project(self.o_proj, o.reshape(x.shape[0], p.q_size), lora)


def set_batch_invariant(model: nn.Module, on: bool) -> int:
    """Route every matmul of `model` (projections, output head, experts) through the batch-invariant
    kernels, or back. Returns how many modules it set. The flag lives on the modules: engines that share
    one loaded model (`LLM.from_config(..., reuse_weights_of)`) share it too, and the last one built sets it."""
    n = 0
    for m in model.modules():
        if hasattr(type(m), "batch_invariant"):
            m.batch_invariant = on
            n += 1
    return n
