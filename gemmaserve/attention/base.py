"""The attention backend interface.

The model runner describes a batch once (`AttentionMetadata`); the backend turns it into a
`BatchAttention` that every layer calls with its new q/k/v. The backend owns the KV memory layout
and states what it can do (`BackendCapabilities`); the rest of the engine asks, never guesses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..kv.base import GroupTables, KVLayout
from ..kv.spec import LayerSpec


@dataclass(frozen=True)
class BackendCapabilities:
    name: str
    devices: frozenset[str]             # torch device types it runs on
    head_dims: frozenset[int] | None    # None: any head dim
    scratch_pages: bool                 # honours per-layer page tables where layers alias one scratch page
    shared_arena: bool                  # can view one byte arena with per-layer page geometry (KV manager V2)
    cuda_graphs: bool = False           # decode batches can be captured (graph_inputs)
    batch_invariant: bool = False       # can reduce a query's keys in one order whatever its batch and chunking


@dataclass
class AttentionMetadata:
    """Layout of one forward pass, shared by all layers.

    Tokens of sequence b are rows [query_start[b], query_start[b] + query_lens[b]) of q/k/v; they sit
    at positions [seq_lens[b] - query_lens[b], seq_lens[b]). Layer l reads and writes the pages of
    column `layer_slot[l][1]` of group `layer_slot[l][0]`: the page of position p of sequence b is
    `slot_pages[block_rows[b, p // T - first_block[b]], column]`, at offset p % T (see GroupTables).

    `image_spans[b]`: positions [start, end) of each image whose tokens see each other (layers that
    ask for it: `bidirectional=True`). The scheduler never ends a chunk inside a span, so a span's
    later keys are always in the cache or in the chunk when its earlier tokens query them.
    """

    query_lens: list[int]
    seq_lens: list[int]
    groups: list[GroupTables]
    layer_slot: tuple[tuple[int, int], ...]
    image_spans: list[list[tuple[int, int]]] | None = None
    # Per sequence of a decode batch: how many keys just before its new token are the new tokens of the
    # sequences just before it in the batch (one sequence's verification rows, run as a decode batch).
    # Backends that write every row's K/V before attending need not look; a traced step does.
    new_before: list[int] | None = None

    def query_ends(self) -> list[int] | None:
        """Per new token (rows of q): the position its keys end before (exclusive): q + 1 (causal),
        or its image's end. None when the batch has no image spans."""
        if not self.image_spans or not any(self.image_spans):
            return None
        ends: list[int] = []
        for n, seq_len, spans in zip(self.query_lens, self.seq_lens, self.image_spans):
            row = list(range(seq_len - n + 1, seq_len + 1))
            for start, end in spans:
                for p in range(max(start, seq_len - n), min(end, seq_len)):
                    row[p - (seq_len - n)] = end
            ends.extend(row)
        return ends

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    def last_tokens(self, seqs: list[int]) -> "AttentionMetadata":
        """The same KV, queried only by the last new token of each of `seqs` (a decode-shaped batch):
        what layers that write no KV need once only the sampled rows matter."""
        groups = [g.select(seqs) for g in self.groups]
        return AttentionMetadata([1] * len(seqs), [self.seq_lens[b] for b in seqs], groups, self.layer_slot)   # a last token never sees a later one


class BatchAttention(ABC):
    """Attention for one batch: writes the new K/V of a layer into its pages, then attends."""

    @abstractmethod
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, *,
                 scale: float, window: int | None, softcap: float | None = None,
                 bidirectional: bool = False) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]. Key k is visible to query q iff
        (k <= q, or `bidirectional` and both are tokens of one image span) and (window is None or
        k > q - window). A layer that reads another layer's KV passes no k/v (None): it writes nothing."""

    def last_tokens(self, seqs: list[int]) -> "BatchAttention":
        """Attention over the same KV for the last new token of each sequence in `seqs` only (see
        AttentionMetadata.last_tokens); only for layers that write no KV."""
        raise NotImplementedError(f"{type(self).__name__} cannot narrow its batch")


class GraphInputs(ABC):
    """Fixed-address inputs of captured decode graphs: one set for the largest batch; the graph of
    a smaller padded size uses the leading rows, and padding rows read and write the null page."""

    @abstractmethod
    def fill(self, metadata: AttentionMetadata | None, size: int) -> None:
        """Copy a decode batch of B <= size sequences in (None: every row is padding)."""

    @abstractmethod
    def attention(self, size: int, layer_slot: tuple[tuple[int, int], ...],
                  kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> BatchAttention:
        """Attention that reads the first `size` rows (what a graph of that size captures)."""


class AttentionBackend(ABC):
    capabilities: BackendCapabilities
    # Set by the engine (`--batch-invariant`, backends whose capabilities allow it) before the KV cache
    # is allocated: a query's output must not depend on its batch, its chunk or the step's kind.
    batch_invariant: bool = False

    @abstractmethod
    def allocate_kv_cache(self, specs: list[LayerSpec], layout: KVLayout,
                          device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (K, V) views of shape [pages, tokens per page, Hkv, D]. Layers that read another
        layer's KV get that layer's views."""

    def graph_inputs(self, max_batch: int, groups, max_model_len: int, null_page: int,
                     device: torch.device, extra_keys: int = 0) -> GraphInputs:
        """Inputs for CUDA-graph decode (backends whose capabilities say `cuda_graphs`). `extra_keys`: keys a
        sliding table holds beyond its window (drafts verified as decode rows, a drafter's lookback)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    @abstractmethod
    def begin_batch(self, metadata: AttentionMetadata,
                    kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> BatchAttention: ...
