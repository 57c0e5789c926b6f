"""LoRA adapters in the engine: names, host memory, device slots.

    LoRARegistry  (engine)     name -> LoRARef: registered once (the adapter read and checked against the model,
                               its digest kept, its weights not)
    AdapterStore  (runner)     adapters read into host memory, least recently used dropped past --max-cpu-loras
                               (read again from their directory when next needed)
    RunnerLoRA    (runner)     the device slots' weights, filled by the plans' loads; a step's LoRABatch
    LoRASlots     (scheduler)  which adapter each of --max-loras device slots holds; a request is admitted only
                               while the running requests use at most --max-loras adapters, so a slot is
                               reassigned only when no running request uses it. The plan names each load
                               (`LoRALoad`) and each sequence's slot (`SeqStep.lora_slot`); the runner copies
                               the weights into the slot (it alone writes them, as it alone writes the KV).

A request's prefix-cache chain starts from a root salted with its adapter's name and weights' digest
(`LoRARef.salt`): KV computed under one adapter is never read under another, nor under a changed one
registered again under the same name.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import UserInputError
from ..models.cpu_kernels import LORA_LOOP_RANK
from ..models.lora import ExpertWeights, LoRABatch, LoRAWeights, SlotWeights, expert_modules, projections
from ..models.lora_adapter import LoRAAdapter, load_adapter
from ..models.quant import QuantLinear
from .step import LoRALoad, SeqStep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRARef:
    """What a request names: an adapter as registered (plain data: it travels in the step description)."""

    name: str
    path: str
    digest: str
    rank: int

    @property
    def key(self) -> str:
        return f"{self.name}@{self.digest}"

    @property
    def salt(self) -> bytes:
        return f"lora\x00{self.key}".encode()


def slot_dtype(module: nn.Module, rank: int, dtype: torch.dtype) -> torch.dtype:
    """What a device slot holds an adapter's A and B in for projection `module` (stacked rank `rank`, activations
    in `dtype`). bf16 over a quantised projection where the CPU op's row loop reads them (rank up to
    LORA_LOOP_RANK): half the bytes each step reads, the delta still computed in fp32; that path's logits move
    as much when the adapter's fp32 weights change in their last bits as when they are rounded to bf16 (its
    activations are quantised too: BENCHMARKS.md, issue 32). Else `dtype`: the fp32 path stays exact against
    PEFT, and higher ranks go to MKL's fp32 products, which would convert them every call."""
    return torch.bfloat16 if isinstance(module, QuantLinear) and rank <= LORA_LOOP_RANK else dtype


def stacked_bytes(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """Device bytes of the stacked slots (`RunnerLoRA` on CUDA): A and B^T of every projection at `max_rank` per
    fused part, `max_loras` slots."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(max_loras * max_rank * len(p.parts) * (p.in_features + sum(p.parts)) * size
               for p in projections(model).values())


class AdapterStore:
    """Adapters read into host memory, at most `capacity` of them (least recently used dropped)."""

    def __init__(self, model: nn.Module, max_rank: int, capacity: int):
        self.model, self.max_rank, self.capacity = model, max_rank, max(1, capacity)
        self._held: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.loads = 0   # reads from disk (tests and metrics)

    def get(self, name: str, path: str, digest: str | None = None) -> LoRAAdapter:
        key = f"{name}@{path}"
        adapter = self._held.get(key)
        if adapter is not None and (digest is None or adapter.digest == digest):
            self._held.move_to_end(key)
            return adapter
        adapter = load_adapter(name, path, self.model, self.max_rank)
        self.loads += 1
        if digest is not None and adapter.digest != digest:
            raise UserInputError(f"LoRA adapter {name!r}: {path} changed on disk since it was registered")
        self._held[key] = adapter
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)
        return adapter


class RunnerLoRA:
    """Runner side: the adapters in the device slots, and which rows of a step use which slot. On CUDA the slots
    are stacked per module (models/lora.py `StackedSlots`, for lora_triton.py's kernels), allocated when the
    first adapter is loaded, at `max_rank` per fused part, so an engine that never serves one pays nothing;
    elsewhere (`stacked` False: the CPU) each slot holds its adapter at its own rank."""

    def __init__(self, model: nn.Module, device: torch.device, max_loras: int, max_rank: int, max_cpu_loras: int,
                 stacked: bool | None = None):
        self.device = device
        self.dtype = model.model.embed_tokens.dtype   # the activations' dtype (fp32 over quantised CPU weights)
        self.store = AdapterStore(model, max_rank, max_cpu_loras)
        self.weights = LoRAWeights(max_loras)
        self.max_rank = max_rank
        self.stacked = device.type == "cuda" if stacked is None else stacked
        self.failed: dict[int, str] = {}   # slot -> why its adapter could not be loaded (until a load succeeds)
        self._model = model
        self._projections = projections(model)
        self._modules = {path: p.module for path, p in self._projections.items()}
        self._experts = expert_modules(model)

    def _allocate(self) -> None:
        need = stacked_bytes(self._model, self.weights.num_slots, self.max_rank, self.dtype)
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else need
        if need > free:   # (the engine reserves them when it starts with adapters; a first one loaded later may not fit)
            raise UserInputError(
                f"LoRA: the device slots for {self.weights.num_slots} adapters of rank up to {self.max_rank} need "
                f"{need / 2**20:.0f} MiB and {free / 2**20:.0f} MiB are free: start with the adapter in "
                "--lora-modules (reserved before the KV cache), or lower --max-loras or --max-lora-rank")
        for p in self._projections.values():
            self.weights.allocate(p.module, self.max_rank * len(p.parts), p.in_features, sum(p.parts), self.dtype,
                                  self.device)
        log.info("LoRA: %d slots stacked for %d projections at rank %d per part: %.1f MiB", self.weights.num_slots,
                 len(self._projections), self.max_rank, self.weights.nbytes / 2**20)

    def load(self, load: LoRALoad) -> None:
        adapter = self.store.get(load.name, load.path, load.digest)
        if self.stacked and not self.weights.stacked:
            self._allocate()
        self.weights.clear(load.slot)
        for path, w in adapter.weights.items():
            module = self._modules[path]
            if self.stacked:   # copied and cast into the slot in place
                self.weights.write(load.slot, module, w.a, w.b)
            else:
                held = SlotWeights(w.a.to(self.device, self.dtype), w.b.to(self.device, self.dtype)).transposed()
                dtype = slot_dtype(module, held.a.shape[0], self.dtype)   # (after `transposed`: B's zeros found in fp32)
                self.weights.put(load.slot, module, SlotWeights(held.a.to(dtype), held.b.to(dtype), held.spans))
        for path, w in adapter.experts.items():   # per slot in either layout (models/lora.py)
            self.weights.put_experts(load.slot, self._experts[path], ExpertWeights(
                *(None if p is None else p.to(self.device, self.dtype) for p in (w.gate_up, w.down))))
        self.failed.pop(load.slot, None)

    def fail(self, slot: int, why: str) -> None:
        """The load into `slot` failed: the slot holds nothing, and a step with its rows raises `why` (the engine
        then reruns the step's sequences one by one, so only that adapter's requests fail)."""
        log.error("%s", why)
        self.weights.clear(slot)
        self.failed[slot] = why

    def batch(self, seqs: list[SeqStep]) -> LoRABatch | None:
        segments, row = [], 0
        for s in seqs:
            if s.lora_slot in self.failed:
                raise RuntimeError(self.failed[s.lora_slot])
            if s.lora_slot >= 0:
                segments.append((row, row + s.num_new_tokens, s.lora_slot))
            row += s.num_new_tokens
        return LoRABatch.from_segments(self.weights, segments, self.device, row) if segments else None


class LoRARegistry:
    """The adapters this engine serves, by name: each read and checked once, when it is added."""

    def __init__(self, model: nn.Module, max_rank: int):
        self.model, self.max_rank = model, max_rank
        self._refs: dict[str, LoRARef] = {}

    def add(self, name: str, path: str | Path) -> LoRARef:
        if not isinstance(name, str) or not name or "=" in name or name != name.strip():
            raise UserInputError(f"LoRA adapter name must be a non-empty string without '=' or outer spaces, "
                                 f"got {name!r}")
        if name in self._refs:
            raise UserInputError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        path = str(Path(path).resolve())
        adapter = load_adapter(name, path, self.model, self.max_rank)
        ref = LoRARef(name, path, adapter.digest, adapter.rank)
        self._refs[name] = ref
        log.info("LoRA adapter %r: rank %d, %d projections, %.1f MiB (%s)", name, adapter.rank,
                 len(adapter.weights), adapter.nbytes / 2**20, path)
        return ref

    def remove(self, name: str) -> LoRARef:
        ref = self._refs.pop(name, None)
        if ref is None:
            raise UserInputError(f"LoRA adapter {name!r} is not loaded")
        return ref

    def get(self, name: str) -> LoRARef:
        ref = self._refs.get(name)
        if ref is None:
            known = ", ".join(sorted(self._refs)) or "none"
            raise UserInputError(f"no LoRA adapter named {name!r} (loaded: {known})")
        return ref

    def names(self) -> list[str]:
        return sorted(self._refs)

    def refs(self) -> list[LoRARef]:
        """Every adapter, by name: a snapshot (the server reads it while the engine thread adds and removes)."""
        return sorted(list(self._refs.values()), key=lambda r: r.name)

    def __contains__(self, name: str) -> bool:
        return name in self._refs


class LoRASlots:
    """Scheduler side: which adapter (by key) each device slot holds."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._held: list[str | None] = [None] * max_loras
        self._last_used = [0] * max_loras
        self._clock = 0

    def fits(self, ref: LoRARef | None, active: set[str]) -> bool:
        """A request with `ref` may join running requests that use the adapters `active`."""
        return ref is None or ref.key in active or len(active) < self.max_loras

    def slot_for(self, ref: LoRARef, active: set[str]) -> tuple[int, LoRALoad | None]:
        """`ref`'s slot, and the load that puts it there if it is not held yet (into a free slot or one whose
        adapter no running request uses, least recently used first)."""
        self._clock += 1
        if ref.key in self._held:
            slot = self._held.index(ref.key)
            self._last_used[slot] = self._clock
            return slot, None
        free = [s for s, k in enumerate(self._held) if k is None or k not in active]
        if not free:
            raise RuntimeError("no LoRA slot is free: admission let more adapters run than --max-loras")
        slot = min(free, key=lambda s: (self._held[s] is not None, self._last_used[s]))
        self._held[slot] = ref.key
        self._last_used[slot] = self._clock
        return slot, LoRALoad(slot, ref.name, ref.path, ref.digest)

    def forget(self, ref: LoRARef) -> None:
        """An unloaded adapter's slot is free (no running request uses it: the engine checks)."""
        if ref.key in self._held:
            self._held[self._held.index(ref.key)] = None
