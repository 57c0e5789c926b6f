"""The runner's copy of the block tables, kept by the scheduler's deltas (engine/step.py).

Per layer group: a host table [rows, W] of slot rows (one row per running sequence, kept while it
runs) with its device mirror, and the group's slot -> page table on the device. A step changes a
few rows (a block fills every T tokens; a window drops one as often), and only those rows are
copied; a batch's tables are then one device gather, so host work per step does not grow with the
context length.

    host rows (sliding group)        first  count     device mirror     batch [b0, b2]
    row 0: s4 s5 s6 . . .              4      3       (dirty rows        block_rows = mirror[[0, 2], :3]
    row 1: s1 s9 . . . .               0      2        copied before     pages      = slot_pages[block_rows]
    row 2: s7 s8 s2 . . .              9      3        the step)
"""

from __future__ import annotations

import numpy as np
import torch

from ..device import to_device
from ..kv.base import GroupTables
from ..kv.groups import KVGroup
from .step import SlotUpdate, TableDelta


class _GroupBlockTables:
    def __init__(self, group: KVGroup, capacity: int, width: int, identity_pages: int | None,
                 device: torch.device):
        self.group = group
        self.device = device
        self.rows = np.zeros((capacity, width), dtype=np.int64)
        self.first = np.zeros(capacity, dtype=np.int64)
        self.count = np.zeros(capacity, dtype=np.int64)
        self.mirror = torch.zeros((capacity, width), dtype=torch.long, device=device)
        self.dirty: set[int] = set()
        if identity_pages is not None:   # V1: slot s is page s (the null page included)
            self.slot_pages = torch.arange(identity_pages, dtype=torch.int32, device=device)[:, None].expand(
                -1, group.num_layers)
            self._identity = True
        else:
            self.slot_pages = torch.zeros((64, group.num_layers), dtype=torch.int32, device=device)
            self._identity = False

    def _grow(self, capacity: int, width: int) -> None:
        rows = np.zeros((capacity, width), dtype=np.int64)
        rows[:self.rows.shape[0], :self.rows.shape[1]] = self.rows
        self.rows = rows
        for name in ("first", "count"):
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=np.int64)
            new[:len(old)] = old
            setattr(self, name, new)
        mirror = torch.zeros((capacity, width), dtype=torch.long, device=self.device)
        mirror[:self.mirror.shape[0], :self.mirror.shape[1]] = self.mirror
        self.mirror = mirror

    def reset(self, row: int) -> None:
        if row >= self.rows.shape[0]:
            self._grow(max(row + 1, 2 * self.rows.shape[0]), self.rows.shape[1])
        self.first[row] = 0
        self.count[row] = 0

    def apply(self, row: int, delta: TableDelta) -> None:
        n = int(self.count[row])
        drop = min(max(0, delta.first - int(self.first[row])), n)
        keep = n - drop
        if keep + len(delta.added) > self.rows.shape[1]:
            self._grow(self.rows.shape[0], max(keep + len(delta.added), 2 * self.rows.shape[1]))
        line = self.rows[row]
        if drop:
            line[:keep] = line[drop:n].copy()
        line[keep:keep + len(delta.added)] = delta.added
        self.first[row] = delta.first
        self.count[row] = keep + len(delta.added)
        self.dirty.add(row)

    def update_slots(self, update: SlotUpdate) -> None:
        if self._identity or not update.rows:
            return
        need = max(update.rows) + 1
        if need > self.slot_pages.shape[0]:
            grown = torch.zeros((max(need, 2 * self.slot_pages.shape[0]), self.group.num_layers), dtype=torch.int32,
                                device=self.device)
            grown[:self.slot_pages.shape[0]] = self.slot_pages
            self.slot_pages = grown
        # A removed slot's row reads -1; nothing references it, but keep indices valid for gathers.
        pages = torch.tensor(update.pages, dtype=torch.int32).clamp_(min=0)
        self.slot_pages[to_device(update.rows, torch.long, self.device)] = to_device(pages, torch.int32, self.device)

    def sync(self) -> None:
        if not self.dirty:
            return
        idx = sorted(self.dirty)
        self.dirty.clear()
        width = int(self.count[idx].max(initial=0))
        if width == 0:
            return
        self.mirror[to_device(idx, torch.long, self.device), :width] = to_device(self.rows[idx, :width], torch.long,
                                                                                 self.device)

    def batch(self, rows: list[int], rows_dev: torch.Tensor) -> GroupTables:
        count = self.count[rows]
        width = max(1, int(count.max(initial=0)))
        return GroupTables(self.group, self.first[rows].tolist(), count.tolist(), self.mirror[rows_dev, :width],
                           self.slot_pages)


class BlockTables:
    """Every group's tables, one row per sequence the scheduler has sent and not released."""

    def __init__(self, groups: tuple[KVGroup, ...], capacity: int, max_model_len: int, identity_pages: int | None,
                 device: torch.device):
        self.device = device
        self._groups = [_GroupBlockTables(g, capacity, g.num_blocks(max_model_len) + 1 if g.window is None
                                          else g.num_blocks(min(g.window, max_model_len)) + 2,
                                          identity_pages, device) for g in groups]
        self._row_of: dict[str, int] = {}
        self._free_rows: list[int] = list(range(capacity - 1, -1, -1))
        self._next_row = capacity

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._row_of

    def apply(self, seq_id: str, deltas: list[TableDelta] | None, new_table: bool) -> None:
        row = self._row_of.get(seq_id)
        if new_table:
            if row is not None:
                raise ValueError(f"sequence {seq_id} already has a block table")
            row = self._free_rows.pop() if self._free_rows else self._take_new_row()
            self._row_of[seq_id] = row
            for g in self._groups:
                g.reset(row)
        elif row is None:
            raise ValueError(f"sequence {seq_id} has no block table (was it released?)")
        if deltas is not None:
            for g, delta in zip(self._groups, deltas):
                g.apply(row, delta)

    def _take_new_row(self) -> int:
        row = self._next_row
        self._next_row += 1
        return row

    def release(self, seq_id: str) -> None:
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)

    def update_slots(self, updates: list[SlotUpdate]) -> None:
        for u in updates:
            self._groups[u.group].update_slots(u)

    def tables(self, seq_ids: list[str]) -> list[GroupTables]:
        """The batch's tables on the device (dirty rows copied first)."""
        rows = [self._row_of[s] for s in seq_ids]
        rows_dev = to_device(rows, torch.long, self.device)
        out = []
        for g in self._groups:
            g.sync()
            out.append(g.batch(rows, rows_dev))
        return out
