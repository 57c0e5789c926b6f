"""Gemma 4's mixture of experts (26B-A4B): a router and grouped expert matmuls, no loop over experts.

    z = RMSNorm_noweight(r) * scale * H^-1/2           router on the residual r
    p = softmax(z @ proj^T) in fp32 over all experts;  w, idx = top-k(p);  w /= sum(w);  w *= per_expert_scale[idx]
    y = sum_k w_k * down_e(gelu(gate_e(x)) * up_e(x))   x = pre_feedforward_layernorm_2(r)

The T x k (token, expert) pairs are sorted by expert, so each expert's rows are contiguous; two
grouped matmuls (`torch._grouped_mm` with per-expert row offsets) run every expert at once. The
outputs go back to (token, k) order and each token's k outputs are summed in fp32 in a fixed order:
no atomics, so the same batch gives the same bits every run (an index_add would not, on the GPU).
Nothing reads a count back to the host, so a CUDA graph can capture it. `GroupedExperts` is all of this but the
two products: `Experts` multiplies by bf16/fp32 weights, quantized_experts.QuantizedExperts by quantised ones.
On the GPU, `Experts` sends steps of up to 8 tokens to moe_kernels.py instead (each pair reads its expert's rows
directly: two launches, no sort; `Experts.fused_decode`).

`batch_invariant` (`--batch-invariant`, set by the engine): the expert matmuls run on the batch-invariant
grouped GEMM (invariant_kernels.py) instead of `torch._grouped_mm`, whose kernel choice depends on the
rows per expert, and the two small sums (router weights, a token's k outputs) are written as additions in
index order, since torch's reduction kernels pick their thread layout from the number of rows. On the CPU
both hold always: the experts' product is cpu_products.py's (an order of its own), the sums in index order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .fused_ops import NormKind, gelu_mul, rms_norm
from .layers import Linear
from .moe_kernels import decode_eligible, experts_decode

if TYPE_CHECKING:
    from .lora import LoRABatch


def _grouped_mm_supported(x: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    # CUDA: bf16 on Hopper and newer (the kernels torch ships); fp32 checks take the fallback.
    return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by expert ([M, K]; expert e owns rows [offsets[e-1], offsets[e])) times that
    expert's w[e] ([E, K, N]) -> [M, N]."""
    if x.device.type == "cpu" and x.dtype == torch.float32:   # each row in the products' own order (cpu_products.py)
        return torch.ops.gemmaserve.grouped_linear(x, w.transpose(1, 2), offsets)
    if _grouped_mm_supported(x):
        return torch._grouped_mm(x, w, offs=offsets)
    # Fallback (fp32 on the GPU, old torch): each row against its expert's matrix, in one batched matmul.
    return torch.bmm(x.unsqueeze(1), w[expert_of_row]).squeeze(1)


@torch.library.custom_op("gemmaserve::grouped_linear", mutates_args=())
def _grouped_linear(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [M, K] with expert e's rows at [ends[e-1], ends[e]), times w[e]^T (w [E, N, K]) -> [M, N]. The
    C++ kernel (cpu_products.py) sums in its own order; this Python kernel, the fallback, runs each
    expert's rows through `linear`'s (rows padded to whole tiles of the BLAS)."""
    from .layers import _padded_linear

    out, start = x.new_empty(x.shape[0], w.shape[1]), 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = _padded_linear(x[start:end], w[e])
        start = end
    return out


@_grouped_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over `dim` (kept as size 1) by elementwise additions in index order: the same bits for a
    row whatever the other rows (a torch reduction's order follows its launch shape)."""
    parts = x.unbind(dim)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total.unsqueeze(dim)


class Router(nn.Module):
    batch_invariant = False

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.top_k = top_k
        self.norm = NormKind(eps, 0.0)
        self.root = hidden ** -0.5
        self.proj = Linear(hidden, num_experts, dtype)
        self.scale = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts, dtype=dtype), requires_grad=False)

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] -> (weights [T, k] fp32, expert ids [T, k])."""
        z = rms_norm(residual, None, self.norm) * self.scale * self.root
        probs = torch.softmax(self.proj(z), dim=-1, dtype=torch.float32)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        ordered = self.batch_invariant or z.device.type == "cpu"   # (a reduction's order is the library's)
        weights = weights / (ordered_sum(weights, -1) if ordered else weights.sum(dim=-1, keepdim=True))
        return weights * self.per_expert_scale[idx], idx


class GroupedExperts(nn.Module):
    """What every experts block does around its two grouped products (`product`, by the subclass: bf16 weights here,
    quantised ones in quantized_experts.py): sort the (token, expert) pairs by expert, gate/up, GeLU-gate, down
    (each with the LoRA deltas of the experts, models/lora.py), weight, unsort and sum each token's k outputs in
    a fixed order. `hidden`, `intermediate`, `num_experts`: the block's geometry (a tensor-parallel rank's share of
    the intermediate)."""

    batch_invariant = False

    def __init__(self, hidden: int, intermediate: int, num_experts: int):
        super().__init__()
        self.hidden = hidden
        self.intermediate = intermediate
        self.num_experts = num_experts

    def product(self, which: str, a: torch.Tensor, offsets: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """Rows `a` sorted by expert (expert e's at [offsets[e-1], offsets[e])) times their expert's `which` matrix
        ("gate_up": [E, 2I, H], "down": [E, H, I]), transposed: [M, 2I] or [M, H] in a's dtype."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                lora: "LoRABatch | None" = None) -> torch.Tensor:
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        expert_of_row = flat[order]
        token_of_row = order // k
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = x[token_of_row]
        gate_up = self.product("gate_up", rows, offsets, expert_of_row)
        if lora is not None:   # adapters of the experts (models/lora.py), on the rows in this order
            gate_up = lora.add_experts(self, "gate_up", rows, gate_up, t, token_of_row, expert_of_row)
        h = gelu_mul(gate_up, self.intermediate)
        y = self.product("down", h, offsets, expert_of_row)
        if lora is not None:
            y = lora.add_experts(self, "down", h, y, t, token_of_row, expert_of_row)
        y = y.float() * weights.reshape(-1)[order, None]
        # Unsort (each row has one destination, so this copy is deterministic), then sum over k.
        per_pair = torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1)
        if self.batch_invariant or per_pair.device.type == "cpu":   # (a reduction's order is the library's)
            return ordered_sum(per_pair, 1).squeeze(1).to(x.dtype)
        return per_pair.sum(dim=1).to(x.dtype)


def float_product(w: torch.Tensor, a: torch.Tensor, offsets: torch.Tensor, expert_of_row: torch.Tensor,
                  batch_invariant: bool) -> torch.Tensor:
    """a (sorted by expert) times w[e]^T for float experts w [E, N, K]: the batch-invariant grouped GEMM, or
    `grouped_mm` (the CPU's row-invariant product for fp32)."""
    wt = w.transpose(1, 2)   # [E, K, N] views, column-major per expert, as grouped_mm wants them
    if batch_invariant:
        from .invariant_kernels import grouped_matmul

        return grouped_matmul(a, wt, offsets)
    return grouped_mm(a, wt, offsets, expert_of_row)


class Experts(GroupedExperts):
    """Expert weights as HF stores them: gate_up_proj [E, 2I, H] ([gate; up] rows), down_proj [E, H, I]."""

    # Few-token steps on CUDA through moe_kernels.py (checked on an H100 by benchmarks/gpu_gemma4 `check`: fp32
    # tokens equal the grouped path's, bf16 graphs equal eager); `profile` turns it off to compare.
    fused_decode = True

    def __init__(self, hidden: int, intermediate: int, num_experts: int, dtype: torch.dtype):
        super().__init__(hidden, intermediate, num_experts)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype), requires_grad=False)

    def product(self, which: str, a: torch.Tensor, offsets: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        w = self.gate_up_proj if which == "gate_up" else self.down_proj
        return float_product(w, a, offsets, expert_of_row, self.batch_invariant)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                lora: "LoRABatch | None" = None) -> torch.Tensor:
        # A few decode tokens on the GPU: each pair reads its expert directly, two launches (moe_kernels.py).
        if (self.fused_decode and lora is None and not self.batch_invariant and x.device.type == "cuda"
                and decode_eligible(x, idx)):
            return experts_decode(x, weights, idx, self.gate_up_proj, self.down_proj, self.intermediate)
        return super().forward(x, weights, idx, lora)
