"""What each attention kind needs from its group's block table: one policy per kind (the shape of vLLM
v1's single-type managers), so the manager's allocation path has no branch on the kind.

A policy answers, for one group, from positions alone:

    first_needed_block(p)   the first block a query at position p (or later) reads; blocks below it are
                            freed (or parked in the prefix cache) at the next commit
    hit_blocks(h)           the blocks a prefix hit of h tokens must find cached
    step_blocks(s, e, keep) the blocks a step computing [s, e) holds, and how many of its new ones may be
                            scratch (one page for every layer: no query after the step reads them)
    rollback_floor(first)   the lowest position a sequence whose table starts at block `first` can go
                            back to and still find every block its next query reads: the room `lookback`
                            buys (a consumer reading behind, a rollback of committed tokens); the
                            manager's integrity check holds every sequence to it. Rejected drafts need
                            none: their KV is never committed (scheduler.py)
    next_drop(p)            the next position > p at which first_needed_block grows

    full attention        needs every block; a hit needs every block below it; never drops; rolls back
                          anywhere
    sliding window W      needs the blocks of the last W (+ lookback) positions; a hit needs only that
                          window tail; drops blocks as the window moves
    KV-shared consumer    a layer that reads another layer's KV (Gemma 4's shared tail, an MTP
                          drafter's layers) owns no block: it reads through its source's group
                          (groups.py), whose policy must keep what the consumer reads. A consumer that
                          queries behind its source (a drafter one step behind, a rollback of committed
                          tokens) widens the source's window by that `lookback`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from .groups import KVGroup
from .spec import AttentionKind

NEVER = 1 << 62


@dataclass(frozen=True)
class StepBlocks:
    held_before: int   # blocks kept from earlier steps that the step's first query reads
    new: int           # blocks the step appends
    scratch: int       # of the new ones, blocks no query after the step reads


class GroupPolicy(ABC):
    reach: int | None = None   # keys a query may still read behind the newest position (None: all)

    def __init__(self, group: KVGroup):
        self.group = group
        self.tokens_per_page = group.tokens_per_page

    @property
    @abstractmethod
    def drops_blocks(self) -> bool:
        """True if blocks leave the table while the sequence runs (the kind frees as it goes)."""

    @abstractmethod
    def first_needed_block(self, position: int) -> int: ...

    def hit_blocks(self, hit: int) -> range:
        return range(self.first_needed_block(hit), hit // self.tokens_per_page)

    def needed_blocks(self, num_tokens: int) -> range:
        """The blocks a sequence of `num_tokens` computed tokens holds between steps."""
        return range(self.first_needed_block(num_tokens), self.group.num_blocks(num_tokens))

    @abstractmethod
    def scratch_below(self, keep: int) -> int:
        """New blocks of a prefill step below this index may be scratch, when the last point inside the
        step where a later request may hit the prefix cache is `keep` (its window stays real)."""

    def step_blocks(self, start: int, end: int, keep: int | None) -> StepBlocks:
        """Blocks a step computing [start, end) holds, as the manager allocates them (`keep`: see
        `scratch_below`; None: no scratch in this step)."""
        first_new = self.group.num_blocks(start)
        end_block = self.group.num_blocks(end)
        stale = 0 if keep is None else max(0, min(self.scratch_below(keep), end_block) - first_new)
        return StepBlocks(first_new - self.first_needed_block(start), end_block - first_new, stale)

    @abstractmethod
    def rollback_floor(self, first_block: int) -> int: ...

    @abstractmethod
    def next_drop(self, num_computed: int) -> int: ...


class FullAttentionPolicy(GroupPolicy):
    drops_blocks = False

    def first_needed_block(self, position: int) -> int:
        return 0

    def scratch_below(self, keep: int) -> int:
        return 0

    def rollback_floor(self, first_block: int) -> int:
        return 0

    def next_drop(self, num_computed: int) -> int:
        return NEVER


class SlidingWindowPolicy(GroupPolicy):
    """A query at p reads keys in (p - W, p]. With `lookback` L, blocks stay until no query at
    p - L or later reads them (a rollback of up to L tokens, or a consumer L positions behind)."""

    drops_blocks = True

    def __init__(self, group: KVGroup, lookback: int = 0):
        super().__init__(group)
        if lookback < 0:
            raise ValueError(f"lookback must be >= 0, got {lookback}")
        self.reach = group.window + lookback   # keys a query may still need behind the newest position

    def first_needed_block(self, position: int) -> int:
        return max(0, position - self.reach + 1) // self.tokens_per_page

    def scratch_below(self, keep: int) -> int:
        return self.first_needed_block(keep)

    def rollback_floor(self, first_block: int) -> int:
        # The lowest p with first_needed_block(p) >= first_block.
        return 0 if first_block == 0 else first_block * self.tokens_per_page + self.reach - 1

    def next_drop(self, num_computed: int) -> int:
        # first_needed_block(p) grows when p - reach + 1 reaches the next block edge
        return (self.first_needed_block(num_computed) + 1) * self.tokens_per_page + self.reach - 1


def policy_for(group: KVGroup, lookback: int = 0) -> GroupPolicy:
    if group.kind is AttentionKind.SLIDING:
        return SlidingWindowPolicy(group, lookback)
    return FullAttentionPolicy(group)
