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
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..device import to_device
from .connector import KVTransfers
from .groups import KVGroup
from .host_tier import HostTier
from .spec import LayerSpec


@dataclass(frozen=True)
class KVLayout:
    """Storage the attention backend allocates."""

    num_pages: int
    page_bytes: int
    shared_arena: bool                # True: one byte arena, every layer views every page (V2)
    tokens_per_page: tuple[int, ...]  # per model layer (a KV-sharing layer: its source's)
    identity_slots: bool = False      # slot s is page s in every layer (V1): no slot table travels


@dataclass
class GroupTables:
    """One group's block tables for the sequences of a batch (live blocks only), as tensors.

    Block i of sequence b (logical index first_block[b] + i, i < num_blocks[b]) is slot row
    block_rows[b, i]; layer column c of the group reads and writes page slot_pages[row, c]. Columns
    beyond num_blocks[b] hold row 0 (a valid index that no visible key reaches).
    """

    group: KVGroup
    first_block: list[int]          # per sequence
    num_blocks: list[int]           # per sequence: live blocks
    block_rows: torch.Tensor        # [B, W] (int64, the runner's device)
    slot_pages: torch.Tensor        # [slots, layers of the group] (int32, the runner's device)

    def select(self, seqs: list[int]) -> "GroupTables":
        idx = to_device(seqs, torch.long, self.block_rows.device)
        return GroupTables(self.group, [self.first_block[b] for b in seqs], [self.num_blocks[b] for b in seqs],
                           self.block_rows[idx], self.slot_pages)


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
    tier: HostTier | None = None    # a host-memory tier behind the prefix cache (V2 only)

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

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no sequence holds, and the hit statistics (after the warm-up)."""

    @abstractmethod
    def allocate(self, seq_id: str, token_ids: list[int], start: int, end: int, prefill: bool,
                 chain: list[bytes] | None = None) -> bool:
        """Make room to compute tokens [start, end) with [0, start) already cached (or hit). Atomic:
        False and no change when the pool cannot supply the pages. A new sequence adopts `chain`
        (its block hashes, as for `lookup`) and keeps extending it."""

    def allocate_computed(self, seq_id: str, token_ids: list[int], num_computed: int) -> bool:
        """Pages for a new sequence whose first `num_computed` tokens were computed elsewhere (a
        disaggregated prefill engine): every block the next query reads, fresh, for the caller to
        fill. Atomic like `allocate`. Its blocks enter the prefix cache only through `cache_computed`."""
        raise NotImplementedError(f"KV manager {self.name} cannot take KV computed elsewhere")

    def cache_computed(self, seq_id: str, token_ids: list[int], chain: list[bytes] | None = None) -> int:
        """Offer the blocks of an `allocate_computed` sequence that hold what was computed elsewhere to the
        prefix cache (a sliding group's first block may be filled only from the window on: not that one), keyed
        on `chain` (the request's, salted by its adapter) when given. Returns how many; 0 where there is no
        prefix cache."""
        return 0

    def commit(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """After a forward pass computed tokens up to `num_computed`."""

    def hold_pages(self, key: str, n: int) -> int:
        """Take up to `n` pages out of the pool under `key` (evicting cached blocks first): KV kept elsewhere that
        counts in this pool's budget (a prefill engine's staged handoffs). Returns how many it took."""
        return 0

    def release_held(self, key: str) -> None:
        """Give back what `hold_pages` took under `key` (nothing if nothing)."""

    def take_transfers(self) -> KVTransfers | None:
        """The copies between the device cache and an outside store decided since the last call, for the
        step being planned (connector.py); None when there is no store."""
        return None

    @abstractmethod
    def free(self, seq_id: str) -> None: ...

    # -- block tables (what the scheduler sends the runner as deltas) -------------------------------
    @abstractmethod
    def block_table(self, seq_id: str, group: int) -> tuple[int, list[int]]:
        """(logical index of the first live block, slot row of each live block) of a sequence in a
        group. The list is the manager's own: read it, do not keep or change it."""

    def slot_changes(self, group: int, cursor: int) -> tuple[list[int] | None, int]:
        """Slot rows of a group created or removed since `cursor` (start at -1), and the new cursor;
        None: too far behind, resend every live row. Identity layouts never change."""
        return [], cursor

    def slot_rows(self, group: int, rows: list[int] | None) -> tuple[list[int], list[list[int]]]:
        """(rows, pages of each layer per row) for `rows`, or for every live row if None."""
        return [], []

    def group_tables(self, seq_ids: list[str], device: torch.device | str = "cpu") -> list[GroupTables]:
        """The batch's block tables built from scratch (tests and tools; the runner keeps its own
        from the scheduler's deltas)."""
        out = []
        for g in self.groups:
            tables = [self.block_table(s, g.index) for s in seq_ids]
            width = max([1] + [len(rows) for _, rows in tables])
            block_rows = torch.zeros(len(seq_ids), width, dtype=torch.long)
            for b, (_, rows) in enumerate(tables):
                block_rows[b, :len(rows)] = torch.tensor(rows, dtype=torch.long)
            if self.layout.identity_slots:
                slot_pages = torch.arange(self.num_pages + 1, dtype=torch.int32)[:, None].expand(-1, g.num_layers)
            else:
                live, pages = self.slot_rows(g.index, None)
                slot_pages = torch.full((max(live, default=-1) + 1 or 1, g.num_layers), 0, dtype=torch.int32)
                if live:
                    slot_pages[torch.tensor(live)] = torch.tensor(pages, dtype=torch.int32)
            out.append(GroupTables(g, [f for f, _ in tables], [len(r) for _, r in tables], block_rows.to(device),
                                   slot_pages.to(device)))
        return out

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
