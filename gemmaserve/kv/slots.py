"""Slots: one logical block of one sequence in one layer group, as one page per layer.

A real slot has one page per layer of its group. A scratch slot maps every layer to the same page:
layers run in order, so each overwrites the previous layer's data, which no later token reads.
Each group keeps its slots as rows of a `slot_pages` table [rows, layers] that attention indexes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(eq=False)
class Slot:
    group: int
    row: int                     # row in the group's slot_pages table
    pages: tuple[int, ...]       # distinct pages this slot holds (one for a scratch slot)
    scratch: bool = False
    ref: int = 0                 # block tables that hold it
    key: bytes | None = None     # content address once registered in the prefix cache
    # A sliding group's block in the window tail of a point where a later request may resume (a prefill
    # chunk's end, a sequence's end): worth keeping in a host tier when evicted (manager_v2.py).
    tail: bool = False


class SlotRows:
    """The slot -> page table of one group (numpy, so a row update costs no tensor construction;
    `tensor()` is a zero-copy torch view), grown by doubling."""

    def __init__(self, num_layers: int, capacity: int = 64):
        self.num_layers = num_layers
        self.table = np.full((capacity, num_layers), -1, dtype=np.int64)
        self._free_rows = list(range(capacity - 1, -1, -1))
        self.live: dict[int, Slot] = {}
        self._log: list[int] = []      # rows changed, in order; entries before _log_base were dropped
        self._log_base = 0

    def changes_since(self, cursor: int) -> tuple[list[int] | None, int]:
        """Rows changed since `cursor` (None: the log was truncated or the table grew, copy it all)."""
        end = self._log_base + len(self._log)
        if cursor < self._log_base:
            return None, end
        return self._log[cursor - self._log_base:], end

    def _changed(self, row: int) -> None:
        self._log.append(row)
        if len(self._log) > 4 * self.table.shape[0]:   # bounded: a consumer this far behind copies everything
            self._log_base += len(self._log)
            self._log = []

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.table)

    def add(self, group: int, pages: list[int], scratch: bool) -> Slot:
        if not self._free_rows:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.full_like(self.table, -1)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
            self._log_base += len(self._log) + 1   # new shape: consumers copy the whole table
            self._log = []
        row = self._free_rows.pop()
        self.table[row] = pages[0] if scratch else pages
        self._changed(row)
        slot = Slot(group, row, tuple(pages), scratch)
        self.live[row] = slot
        return slot

    def remove(self, slot: Slot) -> None:
        del self.live[slot.row]
        self.table[slot.row] = -1
        self._changed(slot.row)
        self._free_rows.append(slot.row)
