"""A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) read against one model.

    base_model.model.<prefix>layers.<i>.<self_attn|mlp>.<q|k|v|o|gate|up|down>_proj.lora_<A|B>.weight
        A [r, in], B [out, r]; delta = B A x * scaling, scaling = alpha / r (alpha / sqrt(r) with rsLoRA),
        r and alpha per module where rank_pattern / alpha_pattern name it

    base_model.model.<prefix>layers.<i>.experts[.base_layer].lora_<A|B>.weight        (target_parameters)
        every expert of a MoE block at once: A [E r, in] (expert-major), B [out, r E] (rank-major), so expert
        e's delta is B[:, e::E] A[e r:(e+1) r] (PEFT's ParamWrapper). PEFT nests one wrapper per targeted
        parameter; which is which follows from the shapes (gate_up_proj maps H -> 2I, down_proj I -> H).

Each HF projection maps onto ours through the model's `stacked` table (q_proj is part 0 of qkv_proj, up_proj
part 1 of gate_up_proj). What we cannot apply is refused with its reason before anything is served: DoRA, bias
training, `modules_to_save`, embeddings, the head, parameters other than the experts' two, encoder towers, a
rank above --max-lora-rank, shapes of another base. A projection the layer does not run (k/v of a KV-shared
layer, v of a K = V layer, which older transformers versions still had) is skipped with a log line: it changes
nothing in transformers either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import UserInputError
from .lora import ExpertPair, ExpertWeights, Projection, SlotWeights, expert_modules, projections

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\."
                  r"(?P<proj>[a-z_]+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")
_EXPERT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<prefix>.*?)layers\.(?P<layer>\d+)\.experts\."
                         r"(?P<nest>(?:base_layer\.)*)lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")
_EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")
_TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "model.text_model.", "")
_TOWERS = ("vision_tower", "audio_tower", "vision_model", "audio_model", "embed_vision", "embed_audio",
           "multi_modal_projector")


@dataclass
class LoRAAdapter:
    """One adapter's weights in host memory, per our projection path: A stacked over the parts, B
    block-diagonal and scaled (see models/lora.py), ready to copy into a device slot."""

    name: str
    path: Path
    rank: int                              # the largest rank of any module
    digest: str                            # of the weights file: the prefix cache keys blocks by it
    weights: dict[str, SlotWeights] = field(default_factory=dict)
    experts: dict[str, ExpertWeights] = field(default_factory=dict)   # MoE experts blocks, by path
    skipped: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return (sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size() for w in self.weights.values())
                + sum(w.nbytes for w in self.experts.values()))


def _read_config(path: Path, name: str) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise UserInputError(f"LoRA adapter {name!r}: {path} has no {CONFIG_FILE} (a PEFT adapter directory)")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise UserInputError(f"LoRA adapter {name!r}: {file} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise UserInputError(f"LoRA adapter {name!r}: {file} must hold a JSON object")
    refuse = []
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        refuse.append(f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    if cfg.get("use_dora"):
        refuse.append("DoRA (use_dora)")
    if cfg.get("bias", "none") != "none":
        refuse.append(f"trained biases (bias={cfg.get('bias')!r})")
    if cfg.get("modules_to_save"):
        refuse.append(f"fully trained modules (modules_to_save={cfg['modules_to_save']})")
    params = cfg.get("target_parameters") or []
    other = [p for p in params if not isinstance(p, str) or not p.endswith(_EXPERT_PARAMS)]
    if other:
        refuse.append(f"LoRA on parameters other than the MoE experts' gate_up_proj and down_proj "
                      f"(target_parameters={other})")
    if refuse:
        raise UserInputError(f"LoRA adapter {name!r} uses {'; '.join(refuse)}, which gemmaserve does not serve")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key, 8), (int, float)) or cfg.get(key, 8) <= 0:
            raise UserInputError(f"LoRA adapter {name!r}: {key} must be a positive number, got {cfg.get(key)!r}")
    return cfg


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name ending with it (as a regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _read_weights(path: Path, name: str) -> tuple[dict[str, torch.Tensor], str]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    file = path / WEIGHTS_FILE
    if not file.is_file():
        other = " (adapter_model.bin is a pickle: save with safe_serialization=True)" \
            if (path / "adapter_model.bin").is_file() else ""
        raise UserInputError(f"LoRA adapter {name!r}: {path} has no {WEIGHTS_FILE}{other}")
    try:
        data = file.read_bytes()   # read once: its digest and its tensors
        tensors = load(data)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UserInputError(f"LoRA adapter {name!r}: {file} could not be read as safetensors: {exc}") from None
    return tensors, hashlib.blake2b(data, digest_size=16).hexdigest()


def load_adapter(name: str, path: str | Path, model: nn.Module, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check the adapter at `path` against `model` (its text layers); UserInputError names what is
    wrong. Weights come back in `dtype` on the CPU."""
    path = Path(path)
    if not path.is_dir():
        raise UserInputError(f"LoRA adapter {name!r}: {path} is not a directory")
    cfg = _read_config(path, name)
    tensors, digest = _read_weights(path, name)
    stacked = getattr(type(model), "stacked", {})
    targets = projections(model)
    plan = getattr(model, "tensor_parallel_plan", None)
    found: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    module_name: dict[tuple[str, int], str] = {}
    skipped: list[str] = []
    experts = expert_modules(model)
    expert_found: dict[str, dict[str, dict[str, torch.Tensor]]] = {}   # path -> nesting -> A/B
    for key, tensor in tensors.items():
        e = _EXPERT_KEY.match(key)
        if e is not None and e["prefix"] in _TEXT_PREFIXES:
            path = f"model.layers.{e['layer']}.experts"
            if path not in experts:
                raise UserInputError(f"LoRA adapter {name!r}: {key} adapts MoE experts, and layer {e['layer']} of "
                                     "this model has none (an adapter for another base model)")
            expert_found.setdefault(path, {}).setdefault(e["nest"], {})[e["ab"]] = tensor
            continue
        m = _KEY.match(key)
        tower = next((t for t in _TOWERS if t in key), None)
        if tower is not None:
            raise UserInputError(f"LoRA adapter {name!r} adapts the {tower} ({key}); gemmaserve applies adapters to "
                                 "the text layers only")
        if m is None or m["prefix"] not in _TEXT_PREFIXES:
            raise UserInputError(f"LoRA adapter {name!r}: {key} is not a LoRA weight of an attention or MLP "
                                 "projection or MoE experts block of the text layers (embeddings and the head "
                                 "are not adapted)")
        leaf, part = stacked.get(m["proj"], (m["proj"], 0))
        ours = f"model.layers.{m['layer']}.{m['block']}.{leaf}"
        hf_name = f"layers.{m['layer']}.{m['block']}.{m['proj']}"
        if int(m["layer"]) >= len(model.model.layers):
            raise UserInputError(f"LoRA adapter {name!r}: {hf_name} is past this model's "
                                 f"{len(model.model.layers)} layers (an adapter for another base model)")
        target = targets.get(ours)
        if target is None:
            raise UserInputError(f"LoRA adapter {name!r}: {hf_name} is not a projection of this model")
        if part >= len(target.parts):
            if hf_name not in skipped:
                skipped.append(hf_name)
            continue
        found.setdefault((ours, part), {})[m["ab"]] = tensor
        module_name[(ours, part)] = f"{m['prefix']}{hf_name}"
    if skipped:
        log.info("LoRA adapter %r: skipped %d projections this model does not run (KV-shared layers project no K/V, "
                 "K = V layers no V): %s", name, len(skipped), ", ".join(skipped[:6]) + (" ..." if len(skipped) > 6
                                                                                       else ""))
    if not found and not expert_found:
        raise UserInputError(f"LoRA adapter {name!r} holds no LoRA weights for this model's projections")
    by_module: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for (ours, part), ab in sorted(found.items()):
        hf_name = module_name[(ours, part)]
        if set(ab) != {"A", "B"}:
            raise UserInputError(f"LoRA adapter {name!r}: {hf_name} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if plan is not None:   # tensor parallelism: this rank's slice, as its base weight is sliced
            a, b = _rank_slice(plan, module_name[(ours, part)], a, b)
        target = targets[ours]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise UserInputError(f"LoRA adapter {name!r}: {hf_name} has A {list(a.shape)} and B {list(b.shape)}, "
                                 "which do not pair")
        if a.shape[1] != target.in_features or b.shape[0] != target.parts[part]:
            raise UserInputError(
                f"LoRA adapter {name!r}: {hf_name} maps {a.shape[1]} -> {b.shape[0]}, this model's projection "
                f"{target.in_features} -> {target.parts[part]}: the adapter belongs to another base model")
        scaling = _scaling(name, cfg, hf_name, r, max_rank)
        by_module.setdefault(ours, []).append((part, a, b.float() * scaling))
        rank = max(rank, r)
    adapter = LoRAAdapter(name, path, rank, digest, skipped=skipped)
    for ours, parts in by_module.items():
        adapter.weights[ours] = _stack(targets[ours], parts, dtype)
    for ours, nested in sorted(expert_found.items()):
        adapter.experts[ours], r = _experts(name, cfg, ours, experts[ours], nested, plan, max_rank, dtype)
        adapter.rank = max(adapter.rank, r)
    return adapter


def _experts(name: str, cfg: dict, ours: str, module: nn.Module, nested: dict[str, dict[str, torch.Tensor]], plan,
             max_rank: int, dtype: torch.dtype) -> tuple[ExpertWeights, int]:
    """One experts block's LoRA, per expert: gate_up_proj and down_proj told apart by their shapes."""
    hf_name = ours.removeprefix("model.")
    n_exp, full_i = module.num_experts, module.intermediate
    hidden = module.hidden
    if plan is not None:
        full_i = plan.experts.get(ours, full_i)
    out, rank = ExpertWeights(), 0
    for ab in nested.values():
        if set(ab) != {"A", "B"}:
            raise UserInputError(f"LoRA adapter {name!r}: {hf_name} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] % n_exp:
            raise UserInputError(f"LoRA adapter {name!r}: {hf_name} has A {list(a.shape)} and B {list(b.shape)}, "
                                 f"which are not a LoRA of {n_exp} experts")
        which = {(hidden, 2 * full_i): "gate_up", (full_i, hidden): "down"}.get((a.shape[1], b.shape[0]))
        if which is None or getattr(out, which) is not None:
            raise UserInputError(
                f"LoRA adapter {name!r}: {hf_name} maps {a.shape[1]} -> {b.shape[0]}; this model's experts map "
                f"{hidden} -> {2 * full_i} (gate_up_proj) and {full_i} -> {hidden} (down_proj): the adapter "
                "belongs to another base model")
        r = a.shape[0] // n_exp   # per expert
        scaling = _scaling(name, cfg, hf_name, r, max_rank)
        if plan is not None:   # this rank's share of the intermediate, as its base experts hold it
            sl = plan.slice_for(f"{ours}.{which}_proj")
            if sl is not None:
                if which == "gate_up":
                    b = dataclasses.replace(sl, dim=0).read(b)
                else:
                    a = dataclasses.replace(sl, dim=1).read(a)
        # A [E, R, in] and B [E, out, R], R = r padded with zeros to a multiple of 8: grouped matmuls want strides
        # of whole 16-byte units (the zeros add exact zeros).
        padded = -(-r // 8) * 8
        a_e = torch.zeros(n_exp, padded, a.shape[1])
        a_e[:, :r] = a.float().reshape(n_exp, r, a.shape[1])
        b_e = torch.zeros(n_exp, b.shape[0], padded)
        b_e[:, :, :r] = (b.float() * scaling).reshape(b.shape[0], r, n_exp).permute(2, 0, 1)
        setattr(out, which, ExpertPair(a_e.to(dtype), b_e.to(dtype)))
        rank = max(rank, r)
    return out, rank


def _scaling(name: str, cfg: dict, hf_name: str, r: int, max_rank: int) -> float:
    """The delta's scale for module `hf_name` of rank `r`, after checking r against the config and the limit."""
    want_r = _pattern_value(cfg.get("rank_pattern"), hf_name, cfg.get("r", r))
    if r != want_r:
        raise UserInputError(f"LoRA adapter {name!r}: {hf_name} has rank {r}, its config says {want_r}")
    if r > max_rank:
        raise UserInputError(f"LoRA adapter {name!r} has rank {r} ({hf_name}), above --max-lora-rank {max_rank}")
    alpha = _pattern_value(cfg.get("alpha_pattern"), hf_name, cfg.get("lora_alpha", 8))
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _rank_slice(plan, hf_name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B for this rank: a column-parallel weight (sliced by output rows) takes the same rows of B and all
    of A; a row-parallel one (sliced by input columns) the same columns of A and all of B, its delta then a
    share that the sum over ranks completes (layers.project)."""
    layers_at = hf_name.index("layers.")
    sl = plan.slice_for(f"model.{hf_name[layers_at:]}.weight")
    if sl is None:
        return a, b
    if sl.dim == 0:
        return a, sl.read(b)
    return sl.read(a), b


def _stack(target: Projection, parts: list[tuple[int, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> SlotWeights:
    """A of every adapted part stacked, B block-diagonal: part j's output rows read only part j's columns."""
    total_r = sum(a.shape[0] for _, a, _ in parts)
    a_all = torch.zeros(total_r, target.in_features, dtype=torch.float32)
    b_all = torch.zeros(sum(target.parts), total_r, dtype=torch.float32)
    offsets = [sum(target.parts[:j]) for j in range(len(target.parts))]
    col = 0
    for part, a, b in parts:
        r = a.shape[0]
        a_all[col:col + r] = a.float()
        b_all[offsets[part]:offsets[part] + target.parts[part], col:col + r] = b.float()
        col += r
    return SlotWeights(a_all.to(dtype), b_all.to(dtype))
