"""A benchmark knob: V2 with its pool pinned between sliding and full groups, as engines with one pool
per life cycle size theirs (`--kv-pool-split`, the ratios seed 004 measures). The engine never sets it
on its own: one pool, no ratio to guess."""

from __future__ import annotations

from collections.abc import Iterator

from .groups import derive_groups
from .manager_v2 import KVCacheManagerV2
from .policy import policy_for
from .spec import LayerSpec


class PinnedSplitKVManager(KVCacheManagerV2):
    name = "v2"

    def __init__(self, specs: list[LayerSpec], page_size: int, num_pages: int, *, sliding_share: float,
                 enable_scratch: bool = False, lookback: int = 0):
        super().__init__(specs, page_size, num_pages, enable_prefix_caching=False, enable_scratch=enable_scratch,
                         lookback=lookback)
        if not 0.0 < sliding_share < 1.0:
            raise ValueError(f"sliding share of the pool must be in (0, 1), got {sliding_share}")
        if {g.sliding for g in self.groups} != {True, False}:
            raise ValueError("a pinned pool split needs both sliding and full groups")
        sliding = int(num_pages * sliding_share)
        self.caps = {True: sliding, False: num_pages - sliding}   # most pages per side (sliding?)

    def _side(self, sliding: bool) -> tuple[int, ...]:
        return tuple(g.index for g in self.groups if g.sliding == sliding)

    def held(self, sliding: bool) -> int:
        """Pages in slots on one side (prefix caching is off: every live slot is held)."""
        return sum(len(slot.pages) for g in self._side(sliding) for slot in self.rows[g].live.values())

    def fits_ever(self, num_tokens: int, chunk: int) -> bool:
        return all(self._peak(num_tokens, chunk, self._side(side)) <= cap for side, cap in self.caps.items())

    def _has_room(self, need: list[int], reviving: int) -> bool:
        if not super()._has_room(need, reviving):
            return False
        return all(self.held(side) + sum(need[g] for g in self._side(side)) <= cap for side, cap in self.caps.items())

    def integrity_steps(self) -> Iterator[None]:
        yield from super().integrity_steps()
        for side, cap in self.caps.items():
            assert self.held(side) <= cap, "a pinned side exceeds its share"


def pinned_pool_split(specs: list[LayerSpec], page_size: int, expected_len: int) -> float:
    """The sliding groups' share of the pages that sequences of `expected_len` tokens hold (the
    live blocks of each group at that length): the ratio a per-life-cycle pool sizing recipe pins
    for that expected input length."""
    pages = {True: 0, False: 0}
    for g in derive_groups(specs, page_size).groups:
        live = g.num_blocks(expected_len + 1) - policy_for(g).first_needed_block(expected_len)
        pages[g.sliding] += live * g.num_layers
    return pages[True] / (pages[True] + pages[False])
