"""The host-memory KV tier, scheduler side: which blocks the store holds, in which of its pages.

Blocks the device's prefix cache evicts move here (a save) and come back on a prefix hit (a load) instead of
being recomputed. The store is an array of pages of the device pool's page size, so a block of a group with L
layers takes L store pages wherever they are free. What is worth keeping is the KV manager's call (every
block of full-attention groups, only window tails of sliding groups, nothing of KV-shared layers, which own no
pages); this class keeps an LRU of what it was given, evicting the least recently used block when it needs
room, and records each copy for the runner (connector.py).

A block saved or loaded in the step being planned is pinned until the plan takes its copies: evicting it
would let a later copy of the same step overwrite store pages an earlier one still reads or writes.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from .connector import BlockCopy, Direction, KVTransfers


@dataclass(eq=False)
class HostBlock:
    group: int
    key: bytes
    pages: tuple[int, ...]      # store pages, one per layer of the group


@dataclass(frozen=True)
class HostTierStats:
    num_pages: int
    page_bytes: int
    pages_used: int
    blocks: int
    saved_blocks: int           # copies to the store since start
    loaded_blocks: int          # copies back (each one a block not recomputed)
    evicted_blocks: int         # dropped to make room
    refused_blocks: int         # not saved: every store page was pinned by the step being planned

    @property
    def bytes_used(self) -> int:
        return self.pages_used * self.page_bytes


class HostTier:
    def __init__(self, num_pages: int, page_bytes: int):
        if num_pages < 1:
            raise ValueError(f"a host tier needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        # A min-heap: the lowest free pages first, so a block's pages and blocks saved together lie in runs
        # the runner copies at once (engine/connectors/host_kv_store.py).
        self._free = list(range(num_pages))
        self._blocks: OrderedDict[tuple[int, bytes], HostBlock] = OrderedDict()   # least recently used first
        self._pinned: set[tuple[int, bytes]] = set()
        self._copies: list[BlockCopy] = []
        self._saved = self._loaded = self._evicted = self._refused = 0

    def get(self, group: int, key: bytes) -> HostBlock | None:
        return self._blocks.get((group, key))

    def save(self, group: int, key: bytes, device_pages: tuple[int, ...]) -> bool:
        """Keep a copy of a block the device is about to give up. False when there is no room for it."""
        k = (group, key)
        if k in self._blocks:   # already here (it came from the store, or was saved before): same content
            self._blocks.move_to_end(k)
            return True
        need = len(device_pages)
        victims = []
        room = len(self._free)
        for other in self._blocks:
            if room >= need:
                break
            if other not in self._pinned:
                victims.append(other)
                room += len(self._blocks[other].pages)
        if room < need:
            self._refused += 1
            return False
        for other in victims:
            self._release(self._blocks.pop(other).pages)
            self._evicted += 1
        pages = tuple(heapq.heappop(self._free) for _ in range(need))
        self._blocks[k] = HostBlock(group, key, pages)
        self._pinned.add(k)
        self._copies.append(BlockCopy(Direction.SAVE, group, list(device_pages), list(pages)))
        self._saved += 1
        return True

    def pin(self, block: HostBlock) -> None:
        """Keep `block` in the store until the step being planned has taken its copies."""
        self._pinned.add((block.group, block.key))

    def load(self, block: HostBlock, device_pages: tuple[int, ...]) -> None:
        """Copy `block` into these device pages before the step's forward (it stays stored too)."""
        k = (block.group, block.key)
        assert self._blocks.get(k) is block and len(device_pages) == len(block.pages)
        self._blocks.move_to_end(k)
        self._pinned.add(k)
        self._copies.append(BlockCopy(Direction.LOAD, block.group, list(device_pages), list(block.pages)))
        self._loaded += 1

    def take(self) -> KVTransfers:
        """The copies decided since the last call (for the step description), unpinning their blocks."""
        out = KVTransfers(self._copies)
        self._copies = []
        self._pinned.clear()
        return out

    def clear(self) -> None:
        """Forget every block (copies already decided still run: their pages stay allocated until taken)."""
        for k in list(self._blocks):
            if k not in self._pinned:
                self._release(self._blocks.pop(k).pages)

    def _release(self, pages: tuple[int, ...]) -> None:
        for p in pages:
            heapq.heappush(self._free, p)

    def block_counts(self) -> dict[int, int]:
        """Blocks held per layer group."""
        out: dict[int, int] = {}
        for group, _ in self._blocks:
            out[group] = out.get(group, 0) + 1
        return out

    def stats(self) -> HostTierStats:
        return HostTierStats(self.num_pages, self.page_bytes, self.num_pages - len(self._free), len(self._blocks),
                             self._saved, self._loaded, self._evicted, self._refused)

    def check_integrity(self) -> None:
        owner: dict[int, tuple[int, bytes]] = {}
        for k, block in self._blocks.items():
            assert (block.group, block.key) == k, "host block filed under another key"
            for p in block.pages:
                assert 0 <= p < self.num_pages and p not in owner, f"host page {p} is in two blocks"
                owner[p] = k
        assert not owner.keys() & set(self._free), "a host page is both free and in a block"
        assert len(owner) + len(self._free) == self.num_pages, (
            f"{len(owner)} host pages in blocks + {len(self._free)} free != {self.num_pages}")
