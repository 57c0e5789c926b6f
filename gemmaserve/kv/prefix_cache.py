"""Content-addressed slots for prefix reuse, with LRU eviction of the unreferenced ones.

Every registered slot is findable by (group, key). A slot that no sequence references (ref == 0)
stays cached and evictable: it sits in the LRU, oldest first, until a hit revives it or an
allocation evicts it.
"""

from __future__ import annotations

from collections import OrderedDict

from .slots import Slot


class PrefixCache:
    def __init__(self) -> None:
        self._by_key: dict[tuple[int, bytes], Slot] = {}
        self._lru: OrderedDict[int, Slot] = OrderedDict()   # id(slot) -> slot, ref == 0 only
        self.evictable_pages = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, group: int, key: bytes) -> Slot | None:
        return self._by_key.get((group, key))

    def register(self, slot: Slot, key: bytes) -> bool:
        """Make `slot` findable by its content. False if another slot already holds that content."""
        k = (slot.group, key)
        if k in self._by_key:
            return False
        slot.key = key
        self._by_key[k] = slot
        return True

    def park(self, slot: Slot) -> None:
        """`slot` lost its last reference: keep it, evictable, as the most recently used."""
        self._lru[id(slot)] = slot
        self.evictable_pages += len(slot.pages)

    def revive(self, slot: Slot) -> None:
        """A hit on a parked slot: it is referenced again, so no longer evictable."""
        if self._lru.pop(id(slot), None) is not None:
            self.evictable_pages -= len(slot.pages)

    def is_parked(self, slot: Slot) -> bool:
        return id(slot) in self._lru

    def evict_oldest(self) -> tuple[Slot, bytes]:
        """The least recently used parked slot, no longer findable, and the key it had."""
        _, slot = self._lru.popitem(last=False)
        self.evictable_pages -= len(slot.pages)
        key = slot.key
        del self._by_key[(slot.group, key)]
        slot.key = None
        return slot, key

    def parked(self) -> list[Slot]:
        return list(self._lru.values())

    def registered(self) -> list[Slot]:
        return list(self._by_key.values())
