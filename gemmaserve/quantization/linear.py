"""`QuantizedLinear`: a Linear layer whose weight stays quantised, y = x W^T in x's dtype.

Life cycle: built empty on its device with parameters named as a compressed-tensors checkpoint names them
(`weight_packed`, `weight_scale`, `weight_zero_point` for W4A16; `weight`, `weight_scale` for FP8), so that
`CausalLM.load_weights` fills them, fused q/k/v and gate/up parts stacked along dim 0 (`part_rows` says how
many rows of each tensor a part takes); then `finish_loading()` reads them into the canonical weight of
schemes.py (exactly: unpacking, no arithmetic) and hands that to the product, dropping the checkpoint's form.
(`from_weight` builds one from a canonical weight directly: `--quantization fp8` at load, and a GGUF file's 4-bit
and 8-bit blocks on CUDA, models/gguf_packed.py, whose Q4_K and Q4_1 weights take the int4 offset form of
schemes.py, and Q8_0 and Q6_K weights the int8 groups (W8A16, which has no checkpoint form).)

The products: on CUDA the kernels (int4_kernels.py, int8_kernels.py: packed integers with dequantisation fused into
the product; fp8_kernels.py: activations quantised per token, then cuBLASLt's or our block kernel). On the CPU the
references:

    W4A16   dequantise in fp32 (any form: symmetric, zero points, offsets), multiply, cast. (On the CPU the
            loader does not use this module for W4A16 where the format maps exactly onto the CPU's own INT4
            kernel, models/quant.py; see models/quantized.py.)
    W8A16   the same: dequantise in fp32 (scale * q), multiply, cast.
    FP8     the scheme itself, activation quantisation included: x quantised per token (per token and bk-column
            group for block weights) to e4m3 with scale amax / 448 (1 for a zero row), then the fp32 product of
            the dequantised operands. The CPU runs these semantics rather than dense dequantised weights so that its
            tokens are the format's (what a GPU's fp8 kernel computes, up to summation order); transformers'
            compressed-tensors path also quantises activations, unless it dequantises at load.

`matmul` is the fp32 product the references use: F.linear, or on the CPU the row-invariant one the loader sets
(models/layers.linear), so a row's result does not depend on its batch there. `batch_invariant`: not supported (the
engine refuses --batch-invariant with quantised weights on CUDA: there is no batch-invariant quantised GEMM yet).
LoRA: `project()` adds deltas over this module's output like any other (in/out widths from the layer's params).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserInputError
from .compressed_tensors import ModuleQuant
from .fp8_kernels import dequantize_activations, fp8_linear, quantize_activations_torch
from .int4_kernels import Int4Packed, int4_linear, pack_int4, unpack_int4
from .int4_pairs import int4_pairs_linear, pairs_eligible
from .int8_kernels import Int8Packed, int8_linear, pack_int8, unpack_int8
from .schemes import FP8_DTYPE, Fp8Weight, Int4Weight, Int8Weight, Scheme

Weight = Int4Weight | Int8Weight | Fp8Weight   # schemes.py's canonical weights


# -- the references (the CPU's products: the row-invariant `matmul` keeps a row's result off its batch) -------
Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def weight_only_reference(x: torch.Tensor, w: Int4Weight | Int8Weight, matmul: Matmul) -> torch.Tensor:
    """The weight-only schemes' reference (int4 and int8 groups alike): fp32 dequantisation, product, cast."""
    return matmul(x.float(), w.dequantize(torch.float32)).to(x.dtype)


def fp8_reference(x: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype, matmul: Matmul) -> torch.Tensor:
    """The fp32 product of the dequantised operands, x quantised per token (per token and bk columns for blocks)."""
    group = x.shape[1] if w.block is None else w.block[1]
    xq, xs = quantize_activations_torch(x, group)
    return matmul(dequantize_activations(xq, xs, group), w.dequantize()).to(out_dtype)


def kernel_layout(w: Weight) -> Weight | Int4Packed | Int8Packed:
    """What a module's product reads: int4 and int8 groups packed for their Triton kernel off the CPU; on the CPU,
    and for fp8 (cuBLASLt or our block kernel take it as it is), the canonical weight."""
    if isinstance(w, Fp8Weight) or w.q.device.type == "cpu":
        return w
    return pack_int8(w) if isinstance(w, Int8Weight) else pack_int4(w)


# -- the checkpoint's packing ---------------------------------------------------------------------------------
def unpack_int4_rows(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [R, W] of eight 4-bit values per word (the first in the lowest bits) -> uint8 [R, cols], 0..15."""
    nibbles = packed.contiguous().view(torch.uint8)   # little-endian words: byte j holds values 2j, 2j + 1
    return torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).view(packed.shape[0], -1)[:, :cols]


def unpack_int4_cols(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [ceil(rows / 8), C] packed along dim 0 (compressed-tensors' zero points) -> uint8 [rows, C]."""
    return unpack_int4_rows(packed.t(), rows).t().contiguous()


def element_span(quant: ModuleQuant, leaf: str) -> tuple[int | None, int | None] | None:
    """Weight rows and columns that one element of checkpoint tensor `leaf` covers: weight_packed's words (1, 8),
    scale groups (1, g), zero points packed eight rows a word (8, g), fp8 blocks' scales (bn, bk); None in a place:
    one element spans that whole dim (a per-channel scale's single column). None: not one of the format's tensors.
    (What a slice of the weight must align with to be a slice of the tensor: tensor parallelism.)"""
    if quant.scheme is Scheme.W8A16:   # no checkpoint tensors (GGUF blocks, one process only)
        return None
    if quant.scheme is Scheme.W4A16:
        return {"weight_packed": (1, 8), "weight_scale": (1, quant.group),
                "weight_zero_point": (8, quant.group)}.get(leaf)
    if leaf == "weight":
        return (1, 1)
    if leaf == "weight_scale":
        return (1, None) if quant.block is None else quant.block
    return None


class QuantizedLinear(nn.Module):
    """y = x W^T with W quantised as `quant` says (see the module docstring). `parts`: the rows of each fused
    part (q/k/v, gate/up), in order; `scale_dtype`: the checkpoint's scale dtype (kept as saved)."""

    def __init__(self, name: str, in_features: int, out_features: int, quant: ModuleQuant, scale_dtype: torch.dtype,
                 parts: tuple[int, ...] | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.name, self.in_features, self.out_features, self.quant = name, in_features, out_features, quant
        self.parts = parts or (out_features,)
        n, k = out_features, in_features
        if quant.scheme is Scheme.W8A16:
            raise ValueError(f"{name}: W8A16 has no checkpoint tensors to load; build it with from_weight")
        if quant.scheme is Scheme.W4A16:
            g = quant.group
            if k % g:
                raise UserInputError(f"{name}: int4 group size {g} does not divide the input width {k} "
                                     "(compressed-tensors pack-quantized)")
            self._param("weight_packed", (n, k // 8), torch.int32, device)
            self._param("weight_scale", (n, k // g), scale_dtype, device)
            if not quant.symmetric:
                self._param("weight_zero_point", (sum(self.part_rows("weight_zero_point", self.parts)), k // g),
                            torch.int32, device)
        else:
            self._param("weight", (n, k), FP8_DTYPE, device)
            rows = sum(self.part_rows("weight_scale", self.parts))
            cols = 1 if quant.block is None else -(-k // quant.block[1])
            self._param("weight_scale", (rows, cols), scale_dtype, device)
        self.kernel_weight: object | None = None   # the product's layout, after finish_loading
        self.matmul: Matmul = F.linear              # the references' product (the loader sets the CPU's)

    def _param(self, leaf: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                                   requires_grad=False))

    def part_rows(self, leaf: str, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """Rows of tensor `leaf` that each fused part of `sizes` weight rows takes (load_weights stacks by them).
        Packed zero points hold 8 rows per word and block scales one row per bn: a part that breaks the packing
        cannot be stacked, and says so."""
        if leaf == "weight_zero_point":
            if len(sizes) > 1 and any(s % 8 for s in sizes):
                raise UserInputError(f"{self.name}: fused parts of {list(sizes)} rows cannot stack int4 zero points "
                                     "packed eight rows per int32 (compressed-tensors weight_zero_point)")
            return tuple(-(-s // 8) for s in sizes)
        if leaf == "weight_scale" and self.quant.block is not None:
            bn = self.quant.block[0]
            if any(s % bn for s in sizes[:-1]):
                raise UserInputError(f"{self.name}: fused parts of {list(sizes)} rows do not align with fp8 blocks "
                                     f"of {bn} rows (compressed-tensors weight_scale)")
            return tuple(-(-s // bn) for s in sizes)
        return tuple(sizes)

    # -- after load_weights ------------------------------------------------------------------------------------
    def canonical(self) -> Int4Weight | Fp8Weight:
        """The loaded tensors as schemes.py's weight (exact: no arithmetic, only unpacking)."""
        n, k = self.out_features, self.in_features
        try:
            if self.quant.scheme is Scheme.W4A16:
                zero = None if self.quant.symmetric else unpack_int4_cols(self.weight_zero_point.data, n)
                return Int4Weight(unpack_int4_rows(self.weight_packed.data, k), self.weight_scale.data, zero,
                                  self.quant.group)
            scale = self.weight_scale.data.float()
            return Fp8Weight(self.weight.data, scale.reshape(n) if self.quant.block is None else scale,
                             self.quant.block)
        except ValueError as exc:
            raise UserInputError(f"{self.name}: {exc} ({self.quant.label}, compressed-tensors)") from None

    def finish_loading(self) -> Int4Weight | Fp8Weight:
        """Canonical weight -> the product's layout; the checkpoint's tensors are dropped. Returns the canonical
        weight (the loader may hand it to another product: the CPU's int4 kernel)."""
        w = self.canonical()
        for leaf in list(self._parameters):
            delattr(self, leaf)
        self.kernel_weight = kernel_layout(w)
        return w

    @classmethod
    def from_weight(cls, name: str, w: Weight, quant: ModuleQuant) -> "QuantizedLinear":
        """A loaded module holding canonical weight `w` (quantised at load, or read elsewhere)."""
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.name, mod.quant, mod.matmul = name, quant, F.linear
        mod.out_features, mod.in_features = w.shape
        mod.parts = (mod.out_features,)
        mod.kernel_weight = kernel_layout(w)
        return mod

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] the product multiplies by (after finish_loading; before it, `canonical()`)."""
        w = self.kernel_weight
        if isinstance(w, Int4Packed):
            w = unpack_int4(w)
        elif isinstance(w, Int8Packed):
            w = unpack_int8(w)
        return w.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        w = self.kernel_weight
        # By the weight's layout (kernel_layout): packed weights go to their kernel (whose own fallback, off
        # CUDA and outside Triton's interpreter, is the fp32 reference), canonical ones to the references with
        # the CPU's row-invariant product.
        if isinstance(w, Int4Packed):   # decode rows of bf16 over bf16 scales: two weights per instruction
            y = int4_pairs_linear(x2, w) if pairs_eligible(x2, w) else int4_linear(x2, w)
        elif isinstance(w, Int8Packed):
            y = int8_linear(x2, w)
        elif isinstance(w, (Int4Weight, Int8Weight)):
            y = weight_only_reference(x2, w, self.matmul)
        elif x.device.type == "cpu":
            y = fp8_reference(x2, w, x.dtype, self.matmul)
        else:
            y = fp8_linear(x2, w, x.dtype)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.quant.label}"
