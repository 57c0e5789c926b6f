"""Building blocks shared by the Gemma models (numerics as in ../shared/reference/gemma-architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class GemmaRMSNorm(nn.Module):
    """Gemma 3 RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back after the multiply."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


# On the CPU, MKL runs x @ W^T up to ~3x slower than (W @ x^T)^T when x has few rows (decode
# batches), most of all for the tall [262k, H] output head. Same math, different loop order.
_CPU_SMALL_BATCH_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for x of shape [T, in]."""
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= _CPU_SMALL_BATCH_ROWS:
        return torch.mm(weight, x.t()).t().contiguous()
    return F.linear(x, weight)


class Linear(nn.Module):
    """y = x W^T with no bias; weights are filled by the loader (no random init)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)); gate and up are one fused matrix [gate; up]."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, dtype)
        self.down_proj = Linear(intermediate, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .fused_ops import gelu_mul

        return self.down_proj(gelu_mul(self.gate_up_proj(x), self.intermediate))


@dataclass(frozen=True)
class RopeParams:
    """NeoX-layout rotary embedding: theta base, and a linear position-scaling factor (1 = none)."""

    theta: float
    linear_factor: float = 1.0

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (self.theta ** exponents) / self.linear_factor

    def cos_sin(self, inv_freq: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, D], computed in fp32 and cast to the activation dtype."""
        angles = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
