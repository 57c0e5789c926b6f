"""`QuantizedExperts`: a MoE experts block (moe.py) whose weights stay quantised: FP8 per (expert, output channel)
from `--quantization fp8`, or a GGUF file's 4-bit expert tensors kept 4-bit on CUDA (gguf_packed.py).

Everything around the two grouped products is moe.GroupedExperts' (sorting the (token, expert) pairs, LoRA deltas
of the experts, unsorting, the ordered sum); only `product` differs:

    CUDA   quantization/grouped_kernels.py: fp8 (activations quantised per token, then the grouped fp8 GEMM) or
           packed int4 (dequantisation fused into the grouped GEMM); nothing read back, so CUDA graphs capture it.
    CPU    the fp32 references (`gemmaserve::quantized_grouped_linear`, one op: a compiled step calls it as it is):
           each expert with rows dequantised in fp32 (fp8: the activations quantised per token first, as the scheme
           says), times its rows by the CPU's row-invariant product (layers.linear, the order of moe.grouped_mm's
           fp32 path): a row's result does not depend on its batch.

A matrix left as None at construction stays a float parameter (`gate_up_proj` [E, 2I, H] or `down_proj` [E, H, I],
the model's dtype) that load_weights fills: a GGUF file whose ffn_down_exps is, say, Q6_K keeps its 4-bit
ffn_gate_up_exps. LoRA adapters of the experts add their deltas over either (models/lora.py, as for bf16 experts).
`batch_invariant` (--batch-invariant) is refused with quantised weights on CUDA by the engine.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..quantization.compressed_tensors import ModuleQuant
from ..quantization.grouped_kernels import Int4ExpertsPacked, QuantExperts, fp8_grouped_linear, grouped_reference, \
    int4_grouped_linear, pack_int4_experts, unpack_int4_experts
from ..quantization.schemes import Fp8Weight, Int4Weight
from .layers import linear
from .moe import GroupedExperts, float_product

WHICH = ("gate_up", "down")


class QuantizedExperts(GroupedExperts):
    """Experts with `gate_up` ([E, 2I, H]) and `down` ([E, H, I]) quantised as `quant` says (QuantExperts on `device`;
    None: that matrix stays a float parameter of `dtype`, to be filled by load_weights)."""

    def __init__(self, name: str, hidden: int, intermediate: int, num_experts: int, gate_up: QuantExperts | None,
                 down: QuantExperts | None, quant: ModuleQuant, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__(hidden, intermediate, num_experts)
        self.name, self.quant, self.dtype = name, quant, dtype
        shapes = {"gate_up": (num_experts, 2 * intermediate, hidden), "down": (num_experts, hidden, intermediate)}
        self.kernel_weights: dict[str, QuantExperts | Int4ExpertsPacked | None] = {}
        for which, w in zip(WHICH, (gate_up, down)):
            if w is None:
                self.register_parameter(f"{which}_proj", nn.Parameter(
                    torch.empty(shapes[which], dtype=dtype, device=device), requires_grad=False))
                self.kernel_weights[which] = None
                continue
            if w.shape != shapes[which]:
                raise ValueError(f"{name}: {which} experts of shape {w.shape}, expected {shapes[which]}")
            on_cpu = w.weight.q.device.type == "cpu"
            self.kernel_weights[which] = w if w.is_fp8 or on_cpu else pack_int4_experts(w)
        if all(w is None for w in self.kernel_weights.values()):
            raise ValueError(f"{name}: quantised experts need at least one quantised matrix")

    @property
    def label(self) -> str:
        """What EngineInfo.weights counts: "fp8 channel experts", "gguf q4_k experts (down bfloat16)"."""
        floats = [w for w in WHICH if self.kernel_weights[w] is None]
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.quant.label} experts" + (f" ({floats[0]} {dtype})" if floats else "")

    def canonical(self, which: str) -> QuantExperts | None:
        """The `which` matrix's quantised weight as schemes' form (None: float)."""
        w = self.kernel_weights[which]
        return unpack_int4_experts(w) if isinstance(w, Int4ExpertsPacked) else w

    def dequantize(self, which: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The `which` matrix [E, N, K] the product multiplies by."""
        w = self.canonical(which)
        return getattr(self, f"{which}_proj").to(dtype) if w is None else w.dequantize(dtype)

    def product(self, which: str, a: torch.Tensor, offsets: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        w = self.kernel_weights[which]
        if w is None:
            return float_product(getattr(self, f"{which}_proj"), a, offsets, expert_of_row, self.batch_invariant)
        if a.device.type == "cpu":   # the references, with the CPU's row-invariant product
            weight = w.weight if isinstance(w, QuantExperts) else unpack_int4_experts(w).weight
            if isinstance(weight, Fp8Weight):
                return torch.ops.gemmaserve.quantized_grouped_linear(a, weight.q, weight.scale, None, None, offsets, 0)
            return torch.ops.gemmaserve.quantized_grouped_linear(a, weight.q, weight.scale, weight.zero, weight.offset,
                                                                 offsets, weight.group)
        if isinstance(w, Int4ExpertsPacked):
            return int4_grouped_linear(a, w, offsets)
        return fp8_grouped_linear(a, w, offsets, a.dtype)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, {self.label}"


@torch.library.custom_op("gemmaserve::quantized_grouped_linear", mutates_args=())
def _quantized_grouped_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                              offset: Optional[torch.Tensor], ends: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] sorted by expert (expert e's rows end at ends[e]) times the experts' quantised weights, stacked rows
    [E * N, K]: fp8 per channel (group 0: q fp8, scale [E * N]) or int4 groups (q uint8 0..15, scale, zero points or
    offsets [E * N, K / group]). The fp32 reference, each expert's product by layers.linear."""
    weight = Fp8Weight(q, scale) if group == 0 else Int4Weight(q, scale, zero, group, offset)
    return grouped_reference(x, QuantExperts(weight, ends.numel()), ends, x.dtype, linear)


@_quantized_grouped_linear.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
      offset: Optional[torch.Tensor], ends: torch.Tensor, group: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0] // ends.numel())
