"""The interface the scheduler and the model runner use, whatever the KV layout.

A manager hands out pages of one pool. Per sequence and layer group it keeps a *block table*: logical
block i (tokens [i*T, (i+1)*T), T = the group's tokens per page) lives in a slot, and a slot maps each
layer of the group to one page. Attention reads layer l's K/V at page `slot_pages[slot, column(l)]`,
offset `position % T`. The manager never touches tensors; the attention backend owns the memory and
allocates it from `KVLayout`.

Life of a sequence, one call each per engine step:

    hit = lookup(seq, tokens)                    # admission only: tokens already cached (0 if none)
    allocate(seq, tokens, start, end, prefill)   # room to compute tokens [start, end); False = no room
    ... forward pass ...
    commit(seq, tokens, end)                     # cache full blocks, drop what no later token reads
    free(seq)                                    # finished, aborted or preempted
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .groups import KVGroup
from .spec import LayerSpec


@dataclass(frozen=True)
class KVLayout:
    """Storage the attention backend allocates."""

    num_pages: int
    page_bytes: int
    shared_arena: bool                # True: one byte arena, every layer views every page (V2)
    tokens_per_page: tuple[int, ...]  # per model layer (a KV-sharing layer: its source's)


@dataclass
class GroupTables:
    """One group's block tables for the sequences of a batch (live blocks only)."""

    group: KVGroup
    first_block: list[int]          # per sequence: logical index of slot_ids[b][0]
    slot_ids: list[list[int]]       # per sequence: slot of each live block, in order
    slot_pages: torch.Tensor        # [slots, layers of the group]: the page of each layer (CPU, int64)
    # Rows of slot_pages changed since a cursor: (rows, new cursor), or (None, cursor) if a full
    # copy is needed. Lets a backend keep a device copy of slot_pages in sync cheaply.
    changes_since: Callable[[int], tuple[list[int] | None, int]] = lambda cursor: ([], cursor)


@dataclass(frozen=True)
class GroupStats:
    group: int
    kind: str
    window: int | None
    num_layers: int
    tokens_per_page: int
    pages_used: int       # held by running sequences (scratch included)
    pages_cached: int     # held only by the prefix cache (evictable)
    scratch_pages: int


@dataclass(frozen=True)
class KVStats:
    num_pages: int
    page_bytes: int
    pages_free: int
    pages_used: int
    pages_cached: int
    scratch_pages: int
    groups: tuple[GroupStats, ...]
    prefix_query_tokens: int
    prefix_hit_tokens: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


class KVCacheManager(ABC):
    name: str

    def __init__(self, specs: list[LayerSpec], page_size: int):
        if page_size < 1:
            raise ValueError(f"page size must be >= 1, got {page_size}")
        self.specs = list(specs)
        self.page_size = page_size

    # -- geometry -----------------------------------------------------------------------------
    @property
    @abstractmethod
    def layout(self) -> KVLayout: ...

    @property
    @abstractmethod
    def groups(self) -> tuple[KVGroup, ...]: ...

    @property
    @abstractmethod
    def layer_slot(self) -> tuple[tuple[int, int], ...]:
        """Per model layer: (group, column) whose pages it reads."""

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    @abstractmethod
    def peak_pages(self, num_tokens: int, chunk: int) -> int:
        """Most pages one sequence of `num_tokens` tokens holds at once when prefilled `chunk` tokens
        per step (an upper bound)."""

    def fits_ever(self, num_tokens: int, chunk: int) -> bool:
        return self.peak_pages(num_tokens, chunk) <= self.num_pages

    def max_chunk(self, num_tokens: int, chunk: int) -> int:
        """The largest step size <= `chunk` with which a sequence of `num_tokens` tokens fits the pool
        (the peak grows with the step size), or 0 if none does."""
        if self.fits_ever(num_tokens, chunk):
            return chunk
        if not self.fits_ever(num_tokens, 1):
            return 0
        lo, hi = 1, chunk
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits_ever(num_tokens, mid) else (lo, mid)
        return lo

    @abstractmethod
    def pages_at(self, num_tokens: int) -> int:
        """Pages a sequence holds between steps once `num_tokens` tokens are computed."""

    @abstractmethod
    def pages_held(self, seq_id: str) -> int:
        """Pages a sequence holds now (0 if unknown)."""

    # -- life cycle ----------------------------------------------------------------------------
    def lookup(self, seq_id: str, token_ids: list[int], chain: list[bytes] | None = None) -> int:
        """Tokens at the start of `token_ids` whose KV can be reused (never the last one). `chain`:
        the sequence's own block hashes (see block_hash.py), extended in place, never recomputed."""
        return 0

    def record_prefix_query(self, query_tokens: int, hit_tokens: int) -> None:
        """Count a request's first lookup in the hit-rate statistics (the scheduler calls it once per
        request: a preempted request finding its own recomputed blocks is no hit)."""

    @abstractmethod
    def allocate(self, seq_id: str, token_ids: list[int], start: int, end: int, prefill: bool,
                 chain: list[bytes] | None = None) -> bool:
        """Make room to compute tokens [start, end) with [0, start) already cached (or hit). Atomic:
        False and no change when the pool cannot supply the pages. A new sequence adopts `chain`
        (its block hashes, as for `lookup`) and keeps extending it."""

    def commit(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """After a forward pass computed tokens up to `num_computed`."""

    @abstractmethod
    def free(self, seq_id: str) -> None: ...

    @abstractmethod
    def group_tables(self, seq_ids: list[str]) -> list[GroupTables]: ...

    # -- observability -------------------------------------------------------------------------
    @property
    @abstractmethod
    def num_free_pages(self) -> int:
        """Pages a new allocation can get (free, or cached and evictable)."""

    @property
    def num_used_pages(self) -> int:
        """Pages held by sequences (cheap; stats() has the breakdown)."""
        return self.num_pages - self.num_free_pages

    @abstractmethod
    def stats(self) -> KVStats: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""

    def integrity_steps(self) -> Iterator[None]:
        """The same check in slices (a generator; managers with large state yield between slices)."""
        self.check_integrity()
        yield from ()
