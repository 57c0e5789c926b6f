"""KV traffic between the device cache and a store outside it, as plain data in the step description: blocks
to and from the host tier (below), and a disaggregated handoff's token rows (`StagedRows`).

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
class RowSpan:
    """One layer's tokens of a transfer in the device cache: token i of the span at (pages[i], offsets[i]). The
    wire holds `rows` rows of the layer's `heads` KV heads for the span; the first `skip` are not written here
    (a receiver that holds fewer tokens of a sliding layer than the sender sent)."""

    layer: int
    pages: list[int]
    offsets: list[int]
    heads: int              # the layer's KV heads in the model (each tensor-parallel rank holds a share)
    rows: int
    skip: int = 0


@dataclass
class StagedRows:
    """A disaggregated handoff's KV as token rows (transfer/plan.py's wire format: per span, K rows then V
    rows): saved after the step's forward into a host buffer the engine takes (the prefill side), or loaded
    before the forward from a buffer the engine gave rank 0's runner (the decode side)."""

    key: str                # the transfer id (saves) or the request id (loads)
    spans: list[RowSpan]
    nbytes: int             # of the whole wire buffer

    @classmethod
    def from_dict(cls, d: dict) -> "StagedRows":
        return cls(d["key"], [RowSpan(**s) for s in d["spans"]], d["nbytes"])


@dataclass
class KVTransfers:
    """A step's copies, in the order the scheduler decided them: block copies and row loads before the
    forward, row saves after it."""

    copies: list[BlockCopy] = field(default_factory=list)
    row_loads: list[StagedRows] = field(default_factory=list)
    row_saves: list[StagedRows] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.copies or self.row_loads or self.row_saves)

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
        d = d or {}
        return cls([BlockCopy(**c) for c in d.get("copies", [])],
                   [StagedRows.from_dict(r) for r in d.get("row_loads", [])],
                   [StagedRows.from_dict(r) for r in d.get("row_saves", [])])
