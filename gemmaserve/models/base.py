"""The model interface: what the engine may ask of a model, and what a model gets from the engine.

    runner --ModelInputs--> model.forward -> hidden [T, H] --> model.compute_logits(rows) -> [N, V]

A model describes itself from its own config: the KV layer specs the cache manager groups
(`kv_layer_specs`), what it would like for "auto" options (`engine_preferences`), and how checkpoint
tensors map onto its parameters (`checkpoint_name`, `gguf_name`, `load_weights`). It knows nothing of
pages, requests or scheduling: attention is the `BatchAttention` inside its inputs.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch
from torch import nn

from ..attention.base import BatchAttention
from ..errors import UserInputError
from ..kv.spec import LayerSpec
from .layers import Attention, GeGLU

if TYPE_CHECKING:
    from .lora import LoRABatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPreferences:
    """What a model class would like when the user leaves an option on "auto"."""

    kv_cache_manager: Literal["v1", "v2"] = "v1"
    swa_scratch_reuse: bool = False
    kv_transfer_runtime: Literal["nixl", "torch"] = "torch"   # disaggregated serving (config/kv_transfer.py)


@dataclass
class ModelInputs:
    """One forward pass: token rows of every sequence, flattened.

    `inputs_embeds` (optional) replaces the token embedding of every row (soft tokens of images come
    this way); models still read `input_ids` for what depends on the token id itself (Gemma 4's
    per-layer embeddings look up id 0 there for such rows).

    `sample_rows` (optional): the only rows whose hidden states are wanted, the last new token of each
    sequence in `sample_seqs` (batch indices). The model returns just those rows, and may skip every
    other row in layers that write no KV (Gemma 4's KV-shared tail, half of E2B's layers).
    """

    input_ids: torch.Tensor                 # [T] int64
    positions: torch.Tensor                 # [T] int64
    attention: BatchAttention
    inputs_embeds: torch.Tensor | None = None
    sample_rows: torch.Tensor | None = None    # [N] int64 rows of the T, one per sequence in sample_seqs
    sample_seqs: list[int] | None = None
    lora: LoRABatch | None = None              # which rows add which adapter's deltas (models/lora.py)


class ModelConfig(Protocol):
    vocab_size: int
    max_position_embeddings: int
    multimodal: bool


class CausalLM(nn.Module, ABC):
    """A decoder the engine serves. Subclasses set `config_class` and implement the abstract hooks."""

    config_class: ClassVar[type]
    # Checkpoint projections stacked into one of our fused weights: part -> (fused name, shard index).
    stacked: ClassVar[dict[str, tuple[str, int]]] = {}
    config: Any

    # -- what the engine asks ------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @abstractmethod
    def kv_layer_specs(self, dtype: torch.dtype) -> list[LayerSpec]:
        """One spec per layer, in order (layers that read another layer's KV name it as `kv_source`)."""

    @abstractmethod
    def engine_preferences(self) -> ModelPreferences: ...

    @abstractmethod
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Final-normed hidden states: [T, H], or [N, H] for `inputs.sample_rows`."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def output_embedding_name(self) -> str:
        """The table `compute_logits` projects onto (quantisation packs a matmul copy of that one table only):
        the checkpoint's own `lm_head` where its config unties the head, else the token embedding."""
        return "model.embed_tokens" if getattr(self.config, "tie_word_embeddings", True) else "lm_head"

    # -- weights ----------------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        """A Hugging Face checkpoint tensor name -> ours, or None to skip it."""
        return name

    def gguf_name(self, name: str) -> tuple[str | None, bool]:
        """A GGUF tensor name -> (our name or None to skip it, stored as 1 + w)."""
        raise UserInputError(f"{type(self).__name__} cannot load GGUF files")

    def shard_sizes(self, fused_name: str) -> tuple[int, ...]:
        """Rows of each part of a fused weight (`stacked`), in shard order, as the module holding it
        has them (a tensor-parallel rank holds its share of each part)."""
        owner = self.get_submodule(fused_name.rsplit(".", 2)[0])
        if isinstance(owner, Attention):
            return owner.p.qkv_sizes
        if isinstance(owner, GeGLU):
            return (owner.intermediate, owner.intermediate)
        raise UserInputError(f"{fused_name} is not a fused weight of this model")

    def map_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for raw, tensor in tensors:
            name = self.checkpoint_name(raw)
            if name is not None:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], deferred: Collection[str] = ()) -> None:
        """Copy tensors (our names) into the model, stacking fused parts. Every parameter must be
        filled exactly once; an unknown tensor or a missing one is an error naming it. `deferred`: parameters
        the caller fills in its own way afterwards (read once `weights` is exhausted, so it may grow meanwhile)."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        shards_seen: dict[str, set[int]] = {}
        for name, tensor in weights:
            parts = name.rsplit(".", 2)
            stacked = self.stacked.get(parts[-2]) if len(parts) == 3 else None
            if stacked is not None:
                target_name = f"{parts[0]}.{stacked[0]}.{parts[-1]}"
                target = params.get(target_name)
                if target is None:
                    raise UserInputError(f"checkpoint tensor {name!r} has no place in the model")
                sizes = self.shard_sizes(target_name)
                if stacked[1] >= len(sizes):
                    raise UserInputError(f"checkpoint tensor {name!r} has no place in the model (this layer has "
                                         f"no {parts[-2]} by its config)")
                # A quantised module's packed tensors give a part fewer rows than its weight (quantization/linear.py).
                part_rows = getattr(self.get_submodule(f"{parts[0]}.{stacked[0]}"), "part_rows", None)
                if part_rows is not None:
                    sizes = part_rows(parts[-1], sizes)
                offset, size = sum(sizes[:stacked[1]]), sizes[stacked[1]]
                if tensor.shape[0] != size or tensor.shape[1:] != target.shape[1:]:
                    raise UserInputError(f"{name}: shape {tuple(tensor.shape)} does not match the config "
                                         f"({size}, {', '.join(map(str, target.shape[1:]))})")
                target.data[offset:offset + size].copy_(tensor)
                shards_seen.setdefault(target_name, set()).add(stacked[1])
                filled.add(target_name)
                continue
            target = params.get(name)
            if target is None:
                raise UserInputError(f"checkpoint tensor {name!r} has no place in the model")
            if tensor.numel() == target.numel() and tensor.dim() <= 1 and target.dim() <= 1:
                tensor = tensor.reshape(target.shape)   # scalars saved as [] or [1]
            if tuple(tensor.shape) != tuple(target.shape):
                raise UserInputError(f"{name}: shape {tuple(tensor.shape)} does not match {tuple(target.shape)}")
            target.data.copy_(tensor)
            filled.add(name)
        incomplete = sorted(n for n, s in shards_seen.items() if len(s) != len(self.shard_sizes(n)))
        missing = sorted(set(params) - filled - set(deferred))
        if "lm_head.weight" in missing:   # (transformers would leave the head random: we refuse)
            raise UserInputError("checkpoint is missing lm_head.weight: its config says tie_word_embeddings: false "
                                 "(an output head apart from the embedding), but it has no such tensor")
        if missing or incomplete:
            raise UserInputError(f"checkpoint is missing weights: {(missing + incomplete)[:5]}")
