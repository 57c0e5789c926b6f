"""A compressed-tensors checkpoint's `quantization_config`, read into a typed plan: which of the checkpoint's
Linear modules hold which scheme (schemes.py), and which stay as saved.

    plan = QuantPlan.from_hf(config["quantization_config"], where)
    plan.for_module("model.layers.0.self_attn.q_proj", is_linear=True) -> ModuleQuant | None

What we run (each config group must be one of these; anything else is refused up front, naming the group):

    W4A16   int4 weights in groups (strategy group, group_size a multiple of 32), symmetric or with zero points;
            activations unquantised; format pack-quantized. Tensors per module:
              weight_packed      int32 [N, K / 8]: value v (-8..7) stored as v + 8, eight per word, the first in
                                 the lowest four bits, along the input dim
              weight_scale       float [N, K / g]
              weight_zero_point  int32 [ceil(N / 8), K / g] (asymmetric only): zero points, stored +8 and packed
                                 the same way but along the output dim
              weight_shape       int [2]: (N, K), checked and dropped
    FP8     float8_e4m3fn weights, strategy channel (weight_scale [N, 1]) with dynamic per-token activations, or
            strategy block (weight_scale [ceil(N / bn), ceil(K / bk)]) with dynamic per-token activations in
            groups of bk; format float-quantized (or naive-quantized, the same tensors). Tensors: weight (fp8),
            weight_scale.

Refused: other bit widths and types (int8, int2, fp4...), quantised int activations, static activation scales,
tensor-wise strategies, output activations, KV-cache schemes, sparsity and transforms, activation reordering
with group indices, and class targets other than "Linear". Targets and `ignore` name modules in the checkpoint's
own names ("model.language_model.layers.0.mlp.down_proj"): exact names, "re:" regexes (matched from the start,
as compressed-tensors does), or the class "Linear". A module matched by several groups takes the most specific
match (exact name, then regex, then class), as compressed-tensors does.

This is our own reading of the format (compressed-tensors is a test reference, not a runtime dependency).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UserInputError
from .schemes import Scheme

QUANT_METHOD = "compressed-tensors"
_INT4_FORMATS = ("pack-quantized",)
_FP8_FORMATS = ("float-quantized", "naive-quantized")
_LINEAR = "Linear"


@dataclass(frozen=True)
class ModuleQuant:
    """How one Linear module's weight is saved."""

    scheme: Scheme
    group: int | None = None                 # W4A16, W8A16: inputs per scale
    symmetric: bool = True                   # W4A16: False -> weight_zero_point (or, from GGUF, an offset)
    block: tuple[int, int] | None = None     # FP8: (bn, bk); None: per output channel
    gguf_type: str | None = None             # read from a GGUF file's blocks instead: its types ("q4_k", "q4_0+q4_k")

    @property
    def label(self) -> str:
        """What EngineInfo.weights counts: "w4a16 g32", "w4a16 g128 asym", "fp8 channel", "fp8 block 128x128",
        "gguf q4_0"."""
        if self.gguf_type is not None:
            return f"gguf {self.gguf_type}"
        if self.scheme is Scheme.W4A16:
            return f"w4a16 g{self.group}" + ("" if self.symmetric else " asym")
        if self.scheme is Scheme.W8A16:
            return f"w8a16 g{self.group}"
        return "fp8 channel" if self.block is None else f"fp8 block {self.block[0]}x{self.block[1]}"

    @property
    def leaves(self) -> tuple[str, ...]:
        """The tensors the checkpoint holds for such a module (after the module's name). W8A16 has none: it is
        read from a GGUF file's blocks only (models/gguf_packed.py)."""
        if self.scheme is Scheme.W8A16:
            raise ValueError("W8A16 weights have no compressed-tensors form (they come from GGUF blocks)")
        if self.scheme is Scheme.W4A16:
            return ("weight_packed", "weight_scale", "weight_shape") + (() if self.symmetric else ("weight_zero_point",))
        return ("weight", "weight_scale")


@dataclass(frozen=True)
class ConfigGroup:
    name: str
    targets: tuple[str, ...]
    quant: ModuleQuant


@dataclass(frozen=True)
class QuantPlan:
    """A checkpoint's quantisation: its config groups and what they leave out."""

    groups: tuple[ConfigGroup, ...]
    ignore: tuple[str, ...]

    @classmethod
    def from_hf(cls, raw: object, where: str) -> "QuantPlan":
        """`raw`: config.json's `quantization_config`; `where`: the file, for messages. UserInputError for anything
        we do not run, listing every unsupported group."""
        if not isinstance(raw, dict):
            raise UserInputError(f"{where}: quantization_config must be a JSON object")
        method = raw.get("quant_method")
        if method != QUANT_METHOD:
            raise UserInputError(f"{where}: quantization method {method!r} is not supported (supported: "
                                 f"{QUANT_METHOD!r})")
        for key, what in (("kv_cache_scheme", "KV-cache quantisation (use --kv-cache-dtype fp8 instead)"),
                          ("sparsity_config", "sparsity"), ("transform_config", "transforms (rotations)"),
                          ("moe_sparsity_config", "MoE expert sparsity")):
            if raw.get(key):
                raise UserInputError(f"{where}: compressed-tensors {key} is not supported: {what}")
        status = raw.get("quantization_status", "compressed")
        if status != "compressed":
            raise UserInputError(f"{where}: compressed-tensors quantization_status {status!r} is not supported "
                                 "(a checkpoint saved compressed, 'compressed', is)")
        top_format = raw.get("format")
        groups_raw = raw.get("config_groups")
        if not isinstance(groups_raw, dict) or not groups_raw:
            raise UserInputError(f"{where}: compressed-tensors config_groups must be a non-empty object")
        groups, refused = [], []
        for name, group in groups_raw.items():
            try:
                groups.append(_group(str(name), group, top_format))
            except _Unsupported as exc:
                refused.append(f"{name!r} ({exc})")
        if refused:
            raise UserInputError(f"{where}: unsupported compressed-tensors config group"
                                 f"{'s' if len(refused) > 1 else ''}: {'; '.join(refused)}. Supported: W4A16 (int4 "
                                 "groups of a multiple of 32, pack-quantized) and FP8 e4m3 weights per channel or in "
                                 "blocks with dynamic per-token activations (float-quantized)")
        ignore = raw.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise UserInputError(f"{where}: compressed-tensors ignore must be a list of module names")
        for pattern in [*ignore, *(t for g in groups for t in g.targets)]:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as exc:
                    raise UserInputError(f"{where}: compressed-tensors pattern {pattern!r}: {exc}") from None
        return cls(tuple(groups), tuple(ignore))

    def for_module(self, name: str, is_linear: bool) -> ModuleQuant | None:
        """The scheme of checkpoint module `name` (a Linear layer of the checkpoint's model when `is_linear`), or
        None where it is saved unquantised."""
        if any(_rank(name, is_linear, pattern) is not None for pattern in self.ignore):
            return None
        best: tuple[int, ModuleQuant] | None = None
        for group in self.groups:
            for target in group.targets:
                rank = _rank(name, is_linear, target)
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, group.quant)
        return None if best is None else best[1]

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(g.quant.label for g in self.groups))


class _Unsupported(Exception):
    """Why one config group is refused (collected, then reported for every group at once)."""


def _rank(name: str, is_linear: bool, pattern: str) -> int | None:
    """How specifically `pattern` matches module `name`: 0 exact, 1 regex, 2 the class; None: no match."""
    if pattern.startswith("re:"):
        return 1 if re.match(pattern[3:], name) else None
    if pattern == name:
        return 0
    return 2 if pattern == _LINEAR and is_linear else None


def _group(name: str, group: object, top_format: object) -> ConfigGroup:
    if not isinstance(group, dict):
        raise _Unsupported("not a JSON object")
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _Unsupported("targets must be a non-empty list of module names")
    for t in targets:
        if not t.startswith("re:") and "." not in t and t[:1].isupper() and t != _LINEAR:
            raise _Unsupported(f"target class {t!r}: only Linear layers are quantised here")
    if group.get("output_activations"):
        raise _Unsupported("quantised output activations")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _Unsupported("no weight quantisation")
    fmt = group.get("format") or top_format
    quant = _int4(weights, group.get("input_activations"), fmt) if weights.get("type", "int") == "int" else \
        _fp8(weights, group.get("input_activations"), fmt)
    return ConfigGroup(name, tuple(targets), quant)


def _int4(w: dict, act: object, fmt: object) -> ModuleQuant:
    bits = w.get("num_bits")
    if bits != 4:
        raise _Unsupported(f"int{bits} weights")
    if act:
        raise _Unsupported("quantised int activations" if isinstance(act, dict) and act.get("type", "int") == "int"
                           else "int4 weights with quantised activations")
    _static_weights(w)
    strategy = w.get("strategy")
    if strategy != "group":
        raise _Unsupported(f"int4 weights with strategy {strategy!r} (supported: group)")
    group = w.get("group_size")
    if not isinstance(group, int) or group <= 0 or group % 32:
        raise _Unsupported(f"int4 group_size {group!r} (supported: a multiple of 32)")
    if w.get("actorder") == "group":
        raise _Unsupported("activation reordering by group (actorder 'group', weight_g_idx)")
    if fmt not in _INT4_FORMATS:
        raise _Unsupported(f"int4 weights in format {fmt!r} (supported: {', '.join(_INT4_FORMATS)})")
    return ModuleQuant(Scheme.W4A16, group=group, symmetric=bool(w.get("symmetric", True)))


def _fp8(w: dict, act: object, fmt: object) -> ModuleQuant:
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _Unsupported(f"{w.get('type')}{w.get('num_bits')} weights")
    _static_weights(w)
    if not w.get("symmetric", True):
        raise _Unsupported("asymmetric fp8 weights")
    strategy = w.get("strategy")
    if strategy == "channel":
        block = None
    elif strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
            raise _Unsupported(f"fp8 block_structure {bs!r}")
        block = (bs[0], bs[1])
    else:
        raise _Unsupported(f"fp8 weights with strategy {strategy!r} (supported: channel, block)")
    if not isinstance(act, dict):
        raise _Unsupported("fp8 weights without activation quantisation (supported: dynamic per-token fp8)")
    if act.get("type") != "float" or act.get("num_bits") != 8 or not act.get("symmetric", True):
        raise _Unsupported(f"fp8 weights with {act.get('type')}{act.get('num_bits')} activations")
    if act.get("dynamic") is not True:
        raise _Unsupported("static activation scales (supported: dynamic per token)")
    want = ("token", None) if block is None else ("group", block[1])
    got = (act.get("strategy"), act.get("group_size") if act.get("strategy") == "group" else None)
    if got != want:
        raise _Unsupported(f"activations by {got[0]}{'' if got[1] is None else f' of {got[1]}'} with "
                           f"{'per-channel' if block is None else 'block'} fp8 weights (supported: "
                           f"{'per token' if block is None else f'per token in groups of {block[1]}'})")
    if fmt not in _FP8_FORMATS:
        raise _Unsupported(f"fp8 weights in format {fmt!r} (supported: {', '.join(_FP8_FORMATS)})")
    return ModuleQuant(Scheme.FP8, block=block)


def _static_weights(w: dict) -> None:
    if w.get("dynamic"):
        raise _Unsupported("dynamic weight scales")
