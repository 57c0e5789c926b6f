"""A GGUF file's 4-bit and 8-bit projections kept packed on CUDA: each attention or MLP projection whose GGUF tensors
(every fused part: q/k/v, gate/up) are all of the types below becomes a QuantizedLinear over its exact weight, which
a Triton kernel multiplies without a dequantised copy: Q4_0, Q4_1 and Q4_K as int4 groups of 32 (schemes.Int4Weight,
int4_kernels.py), Q8_0 and Q6_K as int8 groups (schemes.Int8Weight, int8_kernels.py).

    keeps_packed(device, dtype, quantization, shard)   whether a load does this (CUDA, bf16/fp16, --quantization
                                                       auto, one process)
    planned = plan_packed(model, gguf)                 which of our projections qualify, in which form (checked
                                                       against the model's shapes before anything is read)
    quants = install_packed(model, gguf, planned, device)   those projections become QuantizedLinears on `device`

Each weight is the file's own, exactly (gguf's fp32 dequantisation, bit for bit, read from the blocks by
models/quant.py's readers):

    Q4_0   w = d (q - 8)          int4 symmetric form: scale d (fp16, as saved), zero 8
    Q4_1   w = d q + m            int4 offset form: scale d, offset -m (fp16 both, as saved)
    Q4_K   w = d sc q - dmin m    int4 offset form: scale d * sc, offset dmin * m (fp32: each an exact product of an
                                  fp16 value and a 6-bit integer)
    Q8_0   w = d q                int8 groups of 32: q, scale d (fp16, as saved)
    Q6_K   w = d sc (q - 32)      int8 groups of 16: q - 32 (-32..31), scale d * sc (fp32: an fp16 times an int8)

A fused module whose parts are all 4-bit but of mixed types takes the int4 offset form in fp32 for all of them (a
Q4_0 part's offset is 8 d, exact). One whose parts are Q8_0 and Q6_K, or those with Q4_0 (w = d (q - 8) is int8
groups of 32 too), takes int8 groups of the smallest group among its parts, its scales fp16 if every part's is
(Q8_0, Q4_0), else fp32: a group of 32 split into two of 16 with the same scale is the same weight. Q4_1 and Q4_K
are offset forms, not int8 times a scale: a module mixing them with 8-bit parts is dequantised. Everything else is
loaded as before, dequantised to the model's dtype: matrices of other types (Q5_0, Q5_1, Q5_K, F16, F32...), a
fused module with any part of such a type, the token embedding and an output head. Our modules are found from the
model itself (the `Linear`s of its `Attention` and `GeGLU` modules, fused parts through `stacked`), never from
names of models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UserInputError
from ..quantization.compressed_tensors import ModuleQuant
from ..quantization.grouped_kernels import QuantExperts
from ..quantization.linear import QuantizedLinear
from ..quantization.schemes import Int4Weight, Int8Weight, Scheme
from .gguf_file import GGUFFile, GGUFTensor
from .layers import Attention, GeGLU, Linear, linear
from .quant import GROUP, Int4Groups
from .quantized import our_module, replace_module

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q6_K", "Q4_0")   # exactly int8 times a scale (Q4_0 alone stays 4-bit)
INT8_GROUPS = {"Q8_0": 32, "Q6_K": 16, "Q4_0": 32}


def keeps_packed(device: torch.device, dtype: torch.dtype, quantization: str, shard: object | None) -> bool:
    """Whether a GGUF load keeps its 4-bit and 8-bit projections packed: on CUDA, in bf16 or fp16, with
    `--quantization auto`, in one process (a tensor-parallel rank dequantises, as before: packed weights are not
    split over ranks yet). `none` dequantises everything. (The CPU keeps its own formats, models/quant.py, as
    --dtype says.)"""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and quantization == "auto" \
        and shard is None


@dataclass(frozen=True)
class PackedModule:
    """One of our projections held packed: its GGUF tensors, fused parts in order, their types, and whether it is
    held as int4 (all parts 4-bit) or int8 groups."""
    tensors: tuple[str, ...]
    types: tuple[str, ...]

    @property
    def bits(self) -> int:
        return 4 if all(t in INT4_TYPES for t in self.types) else 8

    @property
    def quant(self) -> ModuleQuant:
        kinds = sorted(set(self.types))
        label = "+".join(kinds).lower()
        if self.bits == 8:
            return ModuleQuant(Scheme.W8A16, min(INT8_GROUPS[t] for t in kinds), gguf_type=label)
        return ModuleQuant(Scheme.W4A16, GROUP, symmetric=kinds == ["Q4_0"], gguf_type=label)


def packed_types(types: list[str]) -> bool:
    """Whether a module with parts of these GGUF types is held packed: all 4-bit (int4), or all exactly int8."""
    return all(t in INT4_TYPES for t in types) or all(t in INT8_TYPES for t in types)


def plan_packed(model: nn.Module, gguf: GGUFFile) -> dict[str, PackedModule]:
    """Our module name -> its GGUF tensors, for each projection whose parts are all present and of types held
    packed (`packed_types`). A tensor of such a type whose shape is not its part's is an error naming it (before
    anything is read)."""
    projections = {f"{n}.{child}": c for n, m in model.named_modules() if isinstance(m, (Attention, GeGLU))
                   for child, c in m.named_children() if isinstance(c, Linear)}
    parts: dict[str, dict[int, GGUFTensor]] = {}
    fused_modules: set[str] = set()
    for t in gguf.tensors():
        ours, _ = model.gguf_name(t.name)
        if ours is None:
            continue
        target, fused = our_module(model, ours)
        if target in projections:
            index = model.stacked[ours.rsplit(".", 2)[1]][1] if fused else 0
            parts.setdefault(target, {})[index] = t
            if fused:
                fused_modules.add(target)
    planned: dict[str, PackedModule] = {}
    for target, found in parts.items():
        lin = projections[target]
        sizes = model.shard_sizes(f"{target}.weight") if target in fused_modules else (lin.out_features,)
        if sorted(found) != list(range(len(sizes))) or not packed_types([t.quant_type for t in found.values()]):
            continue   # a part missing (load_weights names it) or of another type: dequantised as before
        tensors = [found[i] for i in range(len(sizes))]
        for t, rows in zip(tensors, sizes):
            if t.shape != (rows, lin.in_features):
                raise UserInputError(f"GGUF tensor {t.name} ({t.quant_type}) has shape {t.shape}, but {target} "
                                     f"expects {(rows, lin.in_features)} from the file's config")
        planned[target] = PackedModule(tuple(t.name for t in tensors), tuple(t.quant_type for t in tensors))
    return planned


def int4_weight(gguf: GGUFFile, entry: PackedModule) -> Int4Weight:
    """An int4 module's exact weight on the CPU, its parts stacked along the output rows (module docstring)."""
    g = Int4Groups.cat([gguf.int4_groups(name) for name in entry.tensors])   # 2-D 4-bit types: plan_packed
    kinds = set(entry.types)
    if kinds == {"Q4_0"}:   # w = d (q - 8): the symmetric form; d was an fp16 value
        return Int4Weight(g.q, g.scale.to(torch.float16), None, GROUP)
    if kinds == {"Q4_1"}:   # w = d q - (-m): d and m were fp16 values
        return Int4Weight(g.q, g.scale.to(torch.float16), None, GROUP, g.minus.to(torch.float16))
    return Int4Weight(g.q, g.scale, None, GROUP, g.minus)   # Q4_K, or mixed types: fp32 (exact products)


def int8_weight(gguf: GGUFFile, entry: PackedModule) -> Int8Weight:
    """An int8 module's exact weight on the CPU, its parts stacked along the output rows (Int8Weight.cat: the
    smallest group, fp16 scales only where every part's are)."""
    return Int8Weight.cat([gguf.int8_groups(name) for name in entry.tensors])   # 2-D int8 types: plan_packed


def packed_weight(gguf: GGUFFile, entry: PackedModule) -> Int4Weight | Int8Weight:
    return int4_weight(gguf, entry) if entry.bits == 4 else int8_weight(gguf, entry)


def install_packed(model: nn.Module, gguf: GGUFFile, planned: dict[str, PackedModule],
                   device: torch.device) -> dict[str, ModuleQuant]:
    """Each planned projection becomes a QuantizedLinear holding its weight on `device` (packed for the kernel there;
    on the CPU the fp32 reference with the row-invariant product), one module at a time: the Linear it replaces is
    never filled. Returns the modules installed and their labels' ModuleQuant."""
    quants: dict[str, ModuleQuant] = {}
    for name, entry in planned.items():
        new = QuantizedLinear.from_weight(name, packed_weight(gguf, entry).to(device), entry.quant)
        if device.type == "cpu":
            new.matmul = linear
        replace_module(model, name, new)
        quants[name] = entry.quant
    return quants


# -- MoE experts ---------------------------------------------------------------------------------------------------
# A Gemma 4 file's experts are two 3-D tensors per layer, ffn_gate_up_exps [E, 2I, H] and ffn_down_exps [E, H, I]
# (models/gemma4.py maps them onto moe.Experts' gate_up_proj and down_proj). Each that is Q4_0, Q4_1 or Q4_K is kept
# 4-bit, exactly as a projection is (the forms above, over the experts' stacked rows), in a QuantizedExperts
# (quantized_experts.py, the grouped int4 kernel on CUDA); one of another type stays a float parameter of that
# block, dequantised as before; a block with neither stays moe.Experts.
@dataclass(frozen=True)
class Int4ExpertsPlan:
    """One experts block's 4-bit GGUF tensors: gate_up's and down's (None: another type, dequantised)."""
    gate_up: PackedModule | None
    down: PackedModule | None

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(name for part in (self.gate_up, self.down) if part is not None for name in part.tensors)

    @property
    def quant(self) -> ModuleQuant:
        parts = [p for p in (self.gate_up, self.down) if p is not None]
        return PackedModule(self.tensors, tuple(t for p in parts for t in p.types)).quant


class _StackedRows:
    """A GGUF file whose 3-D expert tensors read as their stacked rows [E * N, K] (what `int4_weight` reads)."""

    def __init__(self, gguf: GGUFFile):
        self._gguf = gguf

    def int4_groups(self, name: str):
        return self._gguf.int4_groups(name, stacked=True)


def plan_int4_experts(model: nn.Module, gguf: GGUFFile) -> dict[str, Int4ExpertsPlan]:
    """Our experts block name -> its 4-bit GGUF tensors, for each block with at least one. A 4-bit tensor whose shape
    is not its block's is an error naming it (before anything is read)."""
    from .moe import Experts

    blocks = {n: m for n, m in model.named_modules() if isinstance(m, Experts)}
    found: dict[str, dict[str, PackedModule]] = {}
    for t in gguf.tensors():
        ours, _ = model.gguf_name(t.name)
        if ours is None or t.quant_type not in INT4_TYPES:
            continue
        block, _, leaf = ours.rpartition(".")
        if block not in blocks or leaf not in ("gate_up_proj", "down_proj"):
            continue
        m = blocks[block]
        want = (m.num_experts, 2 * m.intermediate, m.hidden) if leaf == "gate_up_proj" else \
            (m.num_experts, m.hidden, m.intermediate)
        if t.shape != want:
            raise UserInputError(f"GGUF tensor {t.name} ({t.quant_type}) has shape {t.shape}, but {block}.{leaf} "
                                 f"expects {want} from the file's config")
        found.setdefault(block, {})[leaf.removesuffix("_proj")] = PackedModule((t.name,), (t.quant_type,))
    return {block: Int4ExpertsPlan(parts.get("gate_up"), parts.get("down")) for block, parts in found.items()}


def int4_experts(gguf: GGUFFile, part: PackedModule, num_experts: int) -> QuantExperts:
    """One expert tensor's exact weight on the CPU, its experts' rows stacked (the forms of `int4_weight`)."""
    return QuantExperts(int4_weight(_StackedRows(gguf), part), num_experts)


def install_int4_experts(model: nn.Module, gguf: GGUFFile, planned: dict[str, Int4ExpertsPlan], device: torch.device,
                         dtype: torch.dtype) -> dict[str, ModuleQuant]:
    """Each planned experts block becomes a QuantizedExperts holding its 4-bit tensors on `device` (packed for the
    kernel there), one block at a time, its other tensor (if any) a float parameter of `dtype` that load_weights
    fills. Returns the blocks installed and their ModuleQuant."""
    from .quantized_experts import QuantizedExperts

    quants: dict[str, ModuleQuant] = {}
    for name, entry in planned.items():
        old = model.get_submodule(name)
        weights = [None if part is None else int4_experts(gguf, part, old.num_experts).to(device)
                   for part in (entry.gate_up, entry.down)]
        new = QuantizedExperts(name, old.hidden, old.intermediate, old.num_experts, *weights, entry.quant, dtype)
        del old
        replace_module(model, name, new)
        quants[name] = entry.quant
    return quants
