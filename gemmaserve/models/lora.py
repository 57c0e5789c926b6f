"""LoRA deltas on a forward's projections: which rows use which adapter, and adding x A^T B^T to those rows.

    y = W x                       the projection as loaded (bf16/fp32 or a quantised CPU kernel: untouched)
    y[rows of slot s] += (x A_s^T) B_s^T      A_s [R, in], B_s [out, R] with the adapter's scaling folded in

A fused projection (qkv_proj, gate_up_proj) holds one adapter's parts side by side: A_s stacks the parts' A
matrices ([r_q + r_k + r_v, in]) and B_s is block-diagonal (part j's rows take only part j's columns), so one
pair of products serves every part and the zero blocks add exact zeros.

The runner owns the weights (`LoRAWeights`: per projection module and device slot) and builds a `LoRABatch`
per forward from the step description; models pass it down to their projections (`ModelInputs.lora`) and
narrow it where they narrow their rows. Two layouts, two paths, one rule (a row's delta, like its base output,
does not depend on the other rows):

    host     per module and slot a `SlotWeights` (A, B^T at the adapter's own rank); a batch groups its rows by
             slot (`LoRABatch.rows`) and one C++ op (`gemmaserve::lora_add`) or `_lora_add` runs each group
    device   per module one `StackedSlots` (every slot's A and B^T zero padded to the runner's rank allotment,
             allocated once, written in place); a batch holds each row's slot in a device tensor
             (`LoRABatch.slots`) and lora_triton.py's segment kernels run every row at once

MoE experts (PEFT's `target_parameters`: every expert's gate_up_proj / down_proj) hold, per slot, A and B
of each expert side by side ([E, r, in], [E, out, r]: `ExpertPair`), in either layout. The expert rows of a
forward are already sorted by expert (moe.py); a slot's rows keep that order, so two grouped matmuls with that
slot's expert offsets give its deltas (`LoRABatch.add_experts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..device import to_device
from .layers import Attention, GeGLU, linear


@dataclass(frozen=True)
class Projection:
    """One adaptable projection of the model: where it is, what it takes, and its parts' output rows."""

    path: str                  # e.g. "model.layers.3.self_attn.qkv_proj"
    layer: int
    module: nn.Module
    in_features: int
    parts: tuple[int, ...]     # output rows of each fused part, in order (one part if not fused)


def projections(model: nn.Module) -> dict[str, Projection]:
    """Every projection of the text layers a LoRA adapter may target, by our module path. Fused parts follow
    the layer's own shape (a K = V layer's qkv_proj has parts q and k; a KV-shared one only q)."""
    out: dict[str, Projection] = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if isinstance(attn, Attention):
            p = attn.p
            out[f"model.layers.{i}.self_attn.qkv_proj"] = Projection(
                f"model.layers.{i}.self_attn.qkv_proj", i, attn.qkv_proj, p.hidden_size, p.qkv_sizes)
            out[f"model.layers.{i}.self_attn.o_proj"] = Projection(
                f"model.layers.{i}.self_attn.o_proj", i, attn.o_proj, p.q_size, (p.hidden_size,))
        if isinstance(mlp, GeGLU) and isinstance(attn, Attention):
            n, hidden = mlp.intermediate, attn.p.hidden_size
            out[f"model.layers.{i}.mlp.gate_up_proj"] = Projection(
                f"model.layers.{i}.mlp.gate_up_proj", i, mlp.gate_up_proj, hidden, (n, n))
            out[f"model.layers.{i}.mlp.down_proj"] = Projection(
                f"model.layers.{i}.mlp.down_proj", i, mlp.down_proj, n, (hidden,))
    return out


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every MoE experts block of the text layers (moe.Experts or quantized_experts.QuantizedExperts, unwrapped from a
    tensor-parallel collective), by its path: what an adapter's target_parameters may adapt."""
    from .moe import GroupedExperts

    out: dict[str, nn.Module] = {}
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer, "experts", None)
        experts = getattr(experts, "inner", experts)
        if isinstance(experts, GroupedExperts):
            out[f"model.layers.{i}.experts"] = experts
    return out


@dataclass
class ExpertPair:
    """One slot's LoRA of one expert matrix, every expert at once: A [E, r, in] and B [E, out, r] (scaled), whose
    transposes are the column-major [E, K, N] operands grouped matmuls take (as moe.py passes the experts')."""

    a: torch.Tensor
    b: torch.Tensor

    def to(self, device: torch.device, dtype: torch.dtype) -> "ExpertPair":
        return ExpertPair(self.a.to(device, dtype).contiguous(), self.b.to(device, dtype).contiguous())


@dataclass
class ExpertWeights:
    """One slot's LoRA of one experts block: gate_up_proj's and down_proj's (None where not adapted)."""

    gate_up: ExpertPair | None = None
    down: ExpertPair | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in (self.gate_up, self.down) if p is not None
                   for t in (p.a, p.b))


@dataclass
class SlotWeights:
    a: torch.Tensor            # [R, in]
    b: torch.Tensor            # [out, R], scaled, block-diagonal over the parts ([R, out] once `transposed`)
    spans: torch.Tensor | None = None   # [R, 2] int64 (once `transposed`): each rank's part's output rows

    def transposed(self) -> "SlotWeights":
        """B as the CPU kernel reads it ([R, out], contiguous) with each rank's output span: what a device slot
        holds."""
        bt = self.b.t().contiguous()
        nonzero = bt != 0
        first = torch.where(nonzero.any(1), nonzero.int().argmax(1), 0)
        last = torch.where(nonzero.any(1), bt.shape[1] - nonzero.flip(1).int().argmax(1), 0)
        return SlotWeights(self.a.contiguous(), bt, torch.stack([first, last], 1).to(torch.int64).cpu())


@dataclass
class StackedSlots:
    """One module's slots for the segment kernels (lora_triton.py): A [S, R, in] and B^T [S, R, out], R the
    runner's allotment (max rank x fused parts), each slot zero past its adapter's rank. Allocated once and
    written in place, so the addresses never change (what a captured CUDA graph reads)."""

    a: torch.Tensor
    bt: torch.Tensor
    held: set[int] = field(default_factory=set)   # slots whose adapter adapts this module

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot `slot` := A [r, in], B [out, r] (any device and dtype: copied and cast here)."""
        r = a.shape[0]
        if r > self.a.shape[1] or a.shape[1] != self.a.shape[2] or b.shape != (self.bt.shape[2], r):
            raise ValueError(f"LoRA weights A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a slot of "
                             f"A {tuple(self.a.shape[1:])}, B^T {tuple(self.bt.shape[1:])}")
        self.a[slot, :r].copy_(a)
        self.a[slot, r:].zero_()
        self.bt[slot, :r].copy_(b.t())
        self.bt[slot, r:].zero_()
        self.held.add(slot)

    def clear(self, slot: int) -> None:
        if slot in self.held:
            self.a[slot].zero_()
            self.bt[slot].zero_()
            self.held.discard(slot)


@dataclass
class LoRAWeights:
    """The adapters in device slots, per projection module (the runner is their only writer), in one of two
    layouts: per slot, A and B transposed (`SlotWeights.transposed`, `put`), or stacked (`allocate`, `write`)."""

    num_slots: int
    by_module: dict[nn.Module, dict[int, SlotWeights]] = field(default_factory=dict)
    stacked: dict[nn.Module, StackedSlots] = field(default_factory=dict)
    experts: dict[nn.Module, dict[int, ExpertWeights]] = field(default_factory=dict)   # both layouts

    def clear(self, slot: int) -> None:
        for slots in (*self.by_module.values(), *self.experts.values()):
            slots.pop(slot, None)
        for stack in self.stacked.values():
            stack.clear(slot)

    def put(self, slot: int, module: nn.Module, weights: SlotWeights) -> None:
        self.by_module.setdefault(module, {})[slot] = weights

    def put_experts(self, slot: int, module: nn.Module, weights: ExpertWeights) -> None:
        self.experts.setdefault(module, {})[slot] = weights

    def expert_slots(self) -> set[int]:
        """Slots whose adapter adapts some experts block."""
        return {slot for slots in self.experts.values() for slot in slots}

    def allocate(self, module: nn.Module, rank: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """`module`'s stacked slots, zero (no adapter), room for a stacked rank up to `rank`."""
        self.stacked[module] = StackedSlots(
            torch.zeros(self.num_slots, rank, in_features, dtype=dtype, device=device),
            torch.zeros(self.num_slots, rank, out_features, dtype=dtype, device=device))

    def write(self, slot: int, module: nn.Module, a: torch.Tensor, b: torch.Tensor) -> None:
        self.stacked[module].write(slot, a, b)

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked slots."""
        return sum(s.a.numel() * s.a.element_size() + s.bt.numel() * s.bt.element_size()
                   for s in self.stacked.values())


@dataclass
class LoRABatch:
    """Which rows of one forward use which slot: grouped by slot for the host layout (`rows`; rows without an
    adapter are in no group), or each row's slot in a device tensor for the stacked one (`slots`, -1 for none;
    `present` the slots it may name, known on the host so a module no present adapter adapts costs nothing)."""

    weights: LoRAWeights
    rows: dict[int, torch.Tensor]     # slot -> int64 row indices, ascending (host layout)
    slots: torch.Tensor | None = None   # [rows] int32 on the device (stacked layout)
    order: torch.Tensor | None = None   # [rows] int32: the rows sorted by slot (lora_triton.slot_order)
    present: frozenset[int] = frozenset()
    captured: bool = False   # a CUDA graph's batch: every stacked module runs its kernels, whatever is loaded

    @classmethod
    def from_segments(cls, weights: LoRAWeights, segments: list[tuple[int, int, int]],
                      device: torch.device, num_rows: int | None = None) -> "LoRABatch | None":
        """`segments`: (first row, end row, slot) of each sequence with an adapter; None when there are none.
        `num_rows`: the forward's rows (default: the last segment's end; rows past the slot tensor have none)."""
        if not segments:
            return None
        if weights.stacked:
            total = max(end for _, end, _ in segments) if num_rows is None else num_rows
            from .lora_triton import slot_order

            slots = torch.full((total,), -1, dtype=torch.int32)
            for start, end, slot in segments:
                slots[start:end] = slot
            both = to_device(torch.stack([slots, slot_order(slots)]), torch.int32, device)   # one copy
            return cls(weights, {}, both[0], both[1], frozenset(s for _, _, s in segments))
        by_slot: dict[int, list[int]] = {}
        for start, end, slot in segments:
            by_slot.setdefault(slot, []).extend(range(start, end))
        return cls(weights, {s: torch.tensor(r, dtype=torch.long, device=device) for s, r in by_slot.items()})

    def select(self, rows: torch.Tensor) -> "LoRABatch | None":
        """The same adapters for the forward narrowed to `rows` (row i of the result is rows[i] here)."""
        if self.slots is not None:   # on the device, no sync; `present` may now name a slot too many
            from .lora_triton import slot_order

            inside = rows < self.slots.shape[0]
            picked = torch.where(inside, self.slots.index_select(0, torch.where(inside, rows, 0)), -1)
            return LoRABatch(self.weights, {}, picked, slot_order(picked), self.present, self.captured)
        where = {int(r): i for i, r in enumerate(rows.tolist())}
        picked = {}
        for slot, idx in self.rows.items():
            mine = [where[r] for r in idx.tolist() if r in where]
            if mine:
                picked[slot] = torch.tensor(mine, dtype=torch.long, device=idx.device)
        return LoRABatch(self.weights, picked) if picked else None

    @property
    def expert_slots(self) -> set[int]:
        """The slots of this batch whose adapters adapt experts (their rows run outside CUDA graphs: a slot's
        expert rows are found on the host)."""
        mine = set(self.rows) if self.slots is None else set(self.present)
        return mine & self.weights.expert_slots()

    def add_experts(self, module: nn.Module, which: str, x: torch.Tensor, y: torch.Tensor, num_tokens: int,
                    token_of_row: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """y (`which` of `module`: "gate_up" or "down", for the expert rows x, sorted by expert; row i is token
        token_of_row[i]'s pair with expert expert_of_row[i]) plus each row's adapter delta on that expert."""
        slots = self.weights.experts.get(module)
        if not slots or self.captured:   # (the runner runs batches with expert adapters outside CUDA graphs)
            return y
        from .moe import grouped_mm

        slot_of_row = self._slot_of_token(num_tokens, y.device)[token_of_row]
        for slot in sorted(slots):
            pair = getattr(slots[slot], which)
            if pair is None:
                continue
            idx = torch.nonzero(slot_of_row == slot).squeeze(1)
            if idx.numel() == 0:
                continue
            experts = expert_of_row.index_select(0, idx)
            offsets = torch.cumsum(torch.bincount(experts, minlength=pair.a.shape[0]), 0).to(torch.int32)
            xa = grouped_mm(x.index_select(0, idx).to(pair.a.dtype), pair.a.transpose(1, 2), offsets, experts)
            d = grouped_mm(xa, pair.b.transpose(1, 2), offsets, experts)
            y = y.index_add(0, idx, d.to(y.dtype))
        return y

    def _slot_of_token(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        if self.slots is not None:
            return self.slots
        out = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        for slot, idx in self.rows.items():
            out[idx.to(device)] = slot
        return out

    def add(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (module's output for x) plus each row's adapter delta (the stacked layout adds in place: y is the
        module's fresh output)."""
        stack = self.weights.stacked.get(module)
        if stack is not None:
            if self.slots is None or not (self.captured or stack.held & self.present):
                return y
            from . import lora_triton

            return lora_triton.lora_add(y, x, stack.a, stack.bt, self.slots, self.order)
        slots = self.weights.by_module.get(module)
        if not slots:
            return y
        held = [(idx, slots[slot]) for slot, idx in self.rows.items() if slot in slots]
        if not held:
            return y
        rows, a, bt = [i for i, _ in held], [w.a for _, w in held], [w.b for _, w in held]
        if x.device.type == "cpu" and x.dim() == 2:   # one op call for every adapter of the batch (cpu_kernels.py)
            return torch.ops.gemmaserve.lora_add(y, x, rows, a, bt, [w.spans for _, w in held])
        return _lora_add(y, x, rows, a, bt)


def _lora_add(y: torch.Tensor, x: torch.Tensor, rows: list[torch.Tensor], a: list[torch.Tensor],
              bt: list[torch.Tensor]) -> torch.Tensor:
    """y with rows[i] += (x[rows[i]] A_i^T) B_i^T, adapter by adapter (B_i^T given: `bt`; the products
    row-invariant: layers.linear; A and B may be held in bf16 under fp32 x: engine/lora.py's `slot_dtype`)."""
    for idx, ai, bti in zip(rows, a, bt):
        d = linear(linear(x.index_select(0, idx), ai.to(x.dtype)), bti.t().to(x.dtype))
        y = y.index_add(0, idx, d.to(y.dtype))
    return y


@torch.library.custom_op("gemmaserve::lora_add", mutates_args=())
def _lora_add_op(y: torch.Tensor, x: torch.Tensor, rows: list[torch.Tensor], a: list[torch.Tensor],
                 bt: list[torch.Tensor], spans: list[torch.Tensor]) -> torch.Tensor:
    return _lora_add(y, x, rows, a, bt)   # (the spans only let the C++ kernel skip B's zero blocks)


@_lora_add_op.register_fake
def _(y, x, rows, a, bt, spans) -> torch.Tensor:
    return torch.empty_like(y)
