"""KV traffic between the device cache and a store outside it, as plain data in the step description.

A connector has two sides, as vLLM v1's `KVConnector`: the scheduler side (here, beside the KV manager)
decides which blocks move, the runner side executes the copies before the step's forward, so the runner
stays the only writer of the device cache. A step's copies travel in order, as they were decided:

    evict block A (pages 7, 8) -> save      device [7, 8] -> store [0, 1]
    hit on block B from the store -> load   store [4, 5] -> device [7, 8]   (the pages A gave back)

Order matters: A's pages are read before B overwrites them, and a store page is written by a save before
a later load in the same step reads it. The runner may batch consecutive copies of one direction that
touch distinct pages (`runs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Direction(str, Enum):
    SAVE = "save"     # device -> store
    LOAD = "load"     # store -> device


@dataclass
class BlockCopy:
    """One block of one layer group: its pages on the device and in the store, page for page (a block of a
    group with L layers is L pages)."""

    direction: Direction
    group: int
    device_pages: list[int]
    store_pages: list[int]

    def __post_init__(self) -> None:
        self.direction = Direction(self.direction)


@dataclass
class KVTransfers:
    """A step's copies, in the order the scheduler decided them."""

    copies: list[BlockCopy] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.copies)

    def runs(self) -> list[tuple[Direction, list[int], list[int]]]:
        """(direction, device pages, store pages) of consecutive copies that one batched copy may do: same
        direction, and no page written twice (so the batch gives what the copies in order give)."""
        out: list[tuple[Direction, list[int], list[int]]] = []
        written: set[int] = set()
        for c in self.copies:
            dst = c.store_pages if c.direction is Direction.SAVE else c.device_pages
            if not out or out[-1][0] is not c.direction or not written.isdisjoint(dst):
                out.append((c.direction, [], []))
                written = set()
            out[-1][1].extend(c.device_pages)
            out[-1][2].extend(c.store_pages)
            written.update(dst)
        return out

    @classmethod
    def from_dict(cls, d: dict | None) -> "KVTransfers":
        return cls([BlockCopy(**c) for c in (d or {}).get("copies", [])])
