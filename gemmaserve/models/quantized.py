"""A model's quantised Linear layers, from a checkpoint's compressed-tensors plan or quantised at load.

    planned = plan_modules(model, plan, index)   which of our Linears hold which scheme (checked against the
                                                 checkpoint's tensors: names, dtypes, what the plan says)
    install(model, planned, device)              those Linears become empty QuantizedLinears on the device
    ... model.load_weights(...)                  fills them (checkpoint names; fused parts stacked)
    formats = finish(model, planned)             their weights into the products' layouts; counts per format

Our modules are found from the model itself (its `Linear`s, the fused parts of `stacked`), never from names of
models. A checkpoint module maps to ours through the model's own `checkpoint_name`. On the CPU a W4A16 weight
becomes the CPU's INT4 format (models/quant.py: w = s*q - m per 32 inputs in fp32) exactly: s is the scale,
m = scale * zero (zero 8 for symmetric weights), a group of 128 repeats its s and m over its four 32-groups; both
products are exact in fp32 for bf16/fp16 scales, so the kernel multiplies by the format's weight rounded once.
(fp32 scales with zero points may not be: those stay on the reference of quantization/linear.py.)

`quantize_fp8_online` is `--quantization fp8`: every attention and MLP projection of the loaded model to FP8
per output channel (schemes.quantize_fp8_per_channel), and every MoE experts block per (expert, output channel)
into a QuantizedExperts (quantized_experts.py), one module at a time; nothing is written to disk. A
tensor-parallel rank quantises the slices it loaded; a row-parallel slice (o_proj, down_proj, the experts'
down_proj: some of each row's columns) takes its rows' amax over every rank's columns (one all_gather of [N] per
module at load), so every rank holds exactly the tp=1 weight's slice, scales whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UserInputError
from ..quantization.compressed_tensors import ModuleQuant, QuantPlan
from ..quantization.grouped_kernels import QuantExperts
from ..quantization.linear import QuantizedLinear
from ..quantization.schemes import Fp8Weight, Int4Weight, Scheme, quantize_fp8_per_channel
from .layers import Attention, GeGLU, Linear, linear
from .moe import Experts
from .tensor_parallel import ShardPlan

_SCALE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_QUANT_LEAVES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
_CPU_GROUP = 32   # the CPU int4 kernel's group (models/quant.py)


@dataclass(frozen=True)
class TensorInfo:
    """A checkpoint tensor's header: safetensors dtype name ("BF16", "I32", "F8_E4M3") and shape."""
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PlannedModule:
    quant: ModuleQuant
    scale_dtype: torch.dtype
    fused: bool        # q/k/v or gate/up parts stacked into it


def our_module(model: nn.Module, ours: str) -> tuple[str, bool]:
    """Our tensor name (after `checkpoint_name`) -> (the module holding it, whether it is a fused part)."""
    parts = ours.rsplit(".", 2)
    if len(parts) == 3 and parts[1] in model.stacked:
        return f"{parts[0]}.{model.stacked[parts[1]][0]}", True
    return ours.rsplit(".", 1)[0], False


def plan_modules(model: nn.Module, plan: QuantPlan, index: dict[str, TensorInfo]) -> dict[str, PlannedModule]:
    """Our module name -> how it is saved, for each of our Linears the checkpoint holds quantised. Errors name the
    checkpoint tensor or module: quantised tensors the plan does not cover, a planned module missing its tensors or
    saved in another dtype, a quantised module that is not one of our Linears, fused parts saved differently."""
    ckpt_modules: dict[str, set[str]] = {}
    for name in index:
        module, _, leaf = name.rpartition(".")
        ckpt_modules.setdefault(module, set()).add(leaf)
    modules = dict(model.named_modules())
    planned: dict[str, PlannedModule] = {}
    seen_from: dict[str, str] = {}
    for ckpt, leaves in ckpt_modules.items():
        if not leaves & {"weight", "weight_packed"}:
            continue
        ours = model.checkpoint_name(f"{ckpt}.weight")
        if ours is None:
            continue   # not served (towers, KV-shared layers' k/v)
        target, fused = our_module(model, ours)
        is_linear = isinstance(modules.get(target), Linear)
        quant = plan.for_module(ckpt, is_linear)
        saved_quantized = bool(leaves & set(_QUANT_LEAVES))
        if quant is None:
            if saved_quantized:
                raise UserInputError(f"checkpoint module {ckpt!r} holds quantised tensors ({', '.join(sorted(leaves))}) "
                                     "but its compressed-tensors quantization_config leaves it unquantised")
            continue
        if not is_linear:
            raise UserInputError(f"checkpoint module {ckpt!r} is quantised ({quant.label}) but is not a Linear layer "
                                 "of this model: quantised embeddings and MoE experts are not supported")
        for leaf in quant.leaves:
            if leaf not in leaves:
                raise UserInputError(f"checkpoint tensor {ckpt}.{leaf} is missing: {ckpt!r} is {quant.label} "
                                     "(compressed-tensors)")
        _check_dtypes(ckpt, quant, index)
        scale_dtype = _SCALE_DTYPES[index[f"{ckpt}.weight_scale"].dtype]
        entry = PlannedModule(quant, scale_dtype, fused)
        if target in planned and planned[target] != entry:
            raise UserInputError(f"checkpoint modules {seen_from[target]!r} and {ckpt!r} are saved differently "
                                 f"({planned[target].quant.label}, {quant.label}) but are parts of one fused "
                                 f"weight ({target})")
        planned[target], seen_from[target] = entry, ckpt
    for target, ckpt in seen_from.items():   # every part of a fused weight quantised, or none
        if planned[target].fused:
            for other, leaves in ckpt_modules.items():
                if other != ckpt and "weight" in leaves and not leaves & set(_QUANT_LEAVES) and \
                        (ours := model.checkpoint_name(f"{other}.weight")) is not None and \
                        our_module(model, ours)[0] == target:
                    raise UserInputError(f"checkpoint module {other!r} is unquantised but {ckpt!r} is "
                                         f"{planned[target].quant.label}: they are parts of one fused weight ({target})")
    return planned


def _check_dtypes(ckpt: str, quant: ModuleQuant, index: dict[str, TensorInfo]) -> None:
    want = {"weight_packed": ("I32",), "weight_zero_point": ("I32",), "weight_scale": tuple(_SCALE_DTYPES),
            "weight": ("F8_E4M3",)}
    for leaf in quant.leaves:
        info = index[f"{ckpt}.{leaf}"]
        if leaf in want and info.dtype not in want[leaf]:
            raise UserInputError(f"checkpoint tensor {ckpt}.{leaf} is {info.dtype}, expected "
                                 f"{' or '.join(want[leaf])} for {quant.label} (compressed-tensors)")


def check_weight_shape(name: str, shape: torch.Tensor, index: dict[str, TensorInfo]) -> None:
    """A W4A16 module's `weight_shape` (N, K) against its `weight_packed` [N, K / 8]."""
    packed = index.get(name.removesuffix("weight_shape") + "weight_packed")
    got = tuple(int(v) for v in shape.reshape(-1).tolist())
    if packed is None or len(got) != 2 or len(packed.shape) != 2 or \
            (got[0], -(-got[1] // 8)) != packed.shape:
        raise UserInputError(f"checkpoint tensor {name} says {got}, which does not fit weight_packed "
                             f"{None if packed is None else packed.shape} (compressed-tensors pack-quantized)")


def install(model: nn.Module, planned: dict[str, PlannedModule], device: torch.device) -> None:
    """Replace each planned Linear by an empty QuantizedLinear on `device` (the Linear's memory is never touched)."""
    for name, entry in planned.items():
        old = model.get_submodule(name)
        parts = model.shard_sizes(f"{name}.weight") if entry.fused else None
        new = QuantizedLinear(name, old.in_features, old.out_features, entry.quant, entry.scale_dtype, parts, device)
        if device.type == "cpu":
            new.matmul = linear   # the row-invariant product (layers.linear)
        replace_module(model, name, new)


def finish(model: nn.Module, planned: dict[str, PlannedModule]) -> None:
    """After load_weights: each QuantizedLinear into its product's layout; on the CPU an exact W4A16 weight becomes
    the CPU's INT4 module (models/quant.py)."""
    from .quant import Int4Groups, QuantLinear

    for name in planned:
        mod = model.get_submodule(name)
        w = mod.finish_loading()
        if isinstance(w, Int4Weight) and w.q.device.type == "cpu" and _cpu_exact(w):
            rep = w.group // _CPU_GROUP
            scale = w.scale.float().repeat_interleave(rep, dim=1)
            zero = torch.full_like(scale, 8.0) if w.zero is None else w.zero.float().repeat_interleave(rep, dim=1)
            groups = Int4Groups(w.q, scale.contiguous(), (scale * zero).contiguous())
            replace_module(model, name, QuantLinear.from_int4(groups))


def formats(model: nn.Module, quantized: dict[str, ModuleQuant], dtype: torch.dtype) -> dict[str, int]:
    """Modules per weight format, as EngineInfo.weights shows them: {"w4a16 g32": 126, "bfloat16": 3} (the float
    ones: Linear layers and embedding tables left as saved); quantised MoE experts blocks apart, by their own label
    ("fp8 channel experts": 30)."""
    from .layers import Embedding
    from .quantized_experts import QuantizedExperts

    out: dict[str, int] = {}
    for name, quant in quantized.items():
        mod = model.get_submodule(name)
        mod = getattr(mod, "inner", mod)   # (a tensor-parallel collective's wrapper)
        label = mod.label if isinstance(mod, QuantizedExperts) else quant.label
        out[label] = out.get(label, 0) + 1
    plain = sum(isinstance(m, (Linear, Embedding)) for m in model.modules())
    if plain:
        out[str(dtype).removeprefix("torch.")] = plain
    return out


def quantize_fp8_online(model: nn.Module, plan: ShardPlan | None = None,
                        device: torch.device | None = None) -> dict[str, ModuleQuant]:
    """Every attention and MLP projection of a loaded model to FP8 per channel (`--quantization fp8`). `plan`: a
    tensor-parallel rank's (before `parallelize`): row-parallel slices are scaled by their whole rows' amax, every
    rank gathering them in the same module order. `device`: where the fp8 weights go (see quantize_projections)."""
    row_parallel = set(plan.row_parallel()) if plan is not None else set()
    row_parallel |= {f"{n}.down_proj" for n in plan.experts} if plan is not None else set()

    def quantize(name: str, w: torch.Tensor) -> Fp8Weight:
        if name not in row_parallel:
            return quantize_fp8_per_channel(w)
        amax = plan.shard.comm.all_gather_last(w.float().abs().amax(dim=1, keepdim=True))   # [N, ranks]
        return quantize_fp8_per_channel(w, amax.amax(dim=1))

    quant = ModuleQuant(Scheme.FP8)
    return quantize_projections(model, quant, quantize, device) | \
        quantize_expert_blocks(model, quant, over_stacked_rows(quantize), device)


def projection_names(model: nn.Module) -> list[str]:
    """The attention and MLP projections of a model (the `Linear`s of its `Attention` and `GeGLU` modules), in
    module order: what --quantization fp8 quantises."""
    return [f"{n}.{child}" for n, m in model.named_modules() if isinstance(m, (Attention, GeGLU))
            for child, c in m.named_children() if isinstance(c, Linear)]


def quantize_projections(model: nn.Module, quant: ModuleQuant,
                         quantize: Callable[[str, torch.Tensor], Int4Weight | Fp8Weight],
                         device: torch.device | None = None) -> dict[str, ModuleQuant]:
    """Every attention and MLP projection of a loaded model quantised by `quantize` (module name, its float weight
    [N, K] -> the scheme's weight), one module at a time, in module order (each float weight freed as its quantised
    copy exists). `device`: where the quantised weights go, when the float ones were staged elsewhere (the loader
    fills them on the CPU, so the device never holds more than one float projection). Returns the modules
    quantised."""
    names = projection_names(model)
    for name in names:
        old = model.get_submodule(name)
        w = old.weight.data if device is None else old.weight.data.to(device)
        new = QuantizedLinear.from_weight(name, quantize(name, w), quant)
        if w.device.type == "cpu":
            new.matmul = linear
        del old
        replace_module(model, name, new)
    return {name: quant for name in names}


def expert_block_names(model: nn.Module) -> list[str]:
    """The float MoE experts blocks of a model (moe.Experts), in module order: what --quantization fp8 quantises
    besides the projections."""
    return [n for n, m in model.named_modules() if isinstance(m, Experts)]


def over_stacked_rows(quantize: Callable[[str, torch.Tensor], Int4Weight | Fp8Weight]
                      ) -> Callable[[str, torch.Tensor], QuantExperts]:
    """A projection's quantiser (name, weight [N, K]) applied to experts [E, N, K] as their stacked rows [E * N, K]:
    per (expert, output channel) or per (expert, row, group), as QuantExperts holds them."""
    return lambda name, w: QuantExperts(quantize(name, w.reshape(-1, w.shape[2])), w.shape[0])


def quantize_expert_blocks(model: nn.Module, quant: ModuleQuant, quantize: Callable[[str, torch.Tensor], QuantExperts],
                           device: torch.device | None = None) -> dict[str, ModuleQuant]:
    """Every MoE experts block of a loaded model into a QuantizedExperts, each of its two matrices quantised by
    `quantize` (its name, "<block>.gate_up_proj" or "<block>.down_proj", and its float weight [E, N, K] -> the
    experts' quantised weight), one block at a time in module order (as quantize_projections; `device` likewise).
    Returns the blocks quantised."""
    from .quantized_experts import WHICH, QuantizedExperts

    names = expert_block_names(model)
    for name in names:
        old = model.get_submodule(name)
        weights = []
        for which in WHICH:
            w = getattr(old, f"{which}_proj").data
            weights.append(quantize(f"{name}.{which}_proj", w if device is None else w.to(device)))
            del w
        new = QuantizedExperts(name, old.hidden, old.intermediate, old.num_experts, *weights, quant,
                               old.gate_up_proj.dtype)
        del old
        replace_module(model, name, new)
    return {name: quant for name in names}


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Module `name` of `model` becomes `new` (the old one is dropped with its parent's reference)."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def _cpu_exact(w: Int4Weight) -> bool:
    """Whether the CPU kernel's fp32 s and m = s * zero hold the format exactly (bf16/fp16 scales always do)."""
    if w.group % _CPU_GROUP:
        return False
    if w.zero is None or w.scale.dtype in (torch.bfloat16, torch.float16):
        return True
    m = w.scale.double() * w.zero.double()
    return bool((m.float().double() == m).all())
