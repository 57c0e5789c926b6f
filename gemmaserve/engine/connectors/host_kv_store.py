"""The host-memory KV tier, runner side: the store's pages, and the step's copies to and from the device.

The device cache of KV manager V2 is one byte arena of equal pages (attention/torch_backend.py), so a copy
moves whole pages whatever layer they belong to: `arena[page]` <-> `store[page]`. The scheduler side
(kv/host_tier.py) decided which pages; the plan carries the copies in order (kv/connector.py), and they run
before the forward that may overwrite the device pages a save reads.

On CUDA the store is pinned and copies are asynchronous on the compute stream: the host goes on planning the
next step while they run, and the forward that follows them sees their result. On the CPU they are plain
memory copies. Under tensor parallelism every rank keeps its own shard's pages under the same numbers.
"""

from __future__ import annotations

import torch

from ...kv.connector import Direction, KVTransfers


def arena_pages(kv_cache: list[tuple[torch.Tensor, torch.Tensor]], page_bytes: int) -> torch.Tensor:
    """The byte arena behind a shared-arena KV cache as [pages, page_bytes] (every layer's views share it)."""
    storage = kv_cache[0][0].untyped_storage()
    arena = torch.empty(0, dtype=torch.uint8, device=kv_cache[0][0].device).set_(storage)
    return arena[:arena.numel() // page_bytes * page_bytes].view(-1, page_bytes)


class HostKVStore:
    def __init__(self, kv_cache: list[tuple[torch.Tensor, torch.Tensor]], page_bytes: int, num_pages: int):
        self.page_bytes = page_bytes
        self.arena = arena_pages(kv_cache, page_bytes)
        self.device = self.arena.device
        pin = self.device.type == "cuda"
        # empty, not zeros: pages cost host memory only once written (on the CPU).
        self.pages = torch.empty(num_pages, page_bytes, dtype=torch.uint8, pin_memory=pin)

    def execute(self, transfers: KVTransfers) -> None:
        # Device pages lie anywhere in the pool, store pages mostly in runs (host_tier.py allocates the lowest
        # free first): one gather or scatter on the device per run of store pages, and one large copy across,
        # instead of a copy per page (small copies reach a fraction of PCIe's bandwidth).
        pin = self.device.type == "cuda"
        for direction, device_pages, store_pages in transfers.runs():
            for dev, h, n in _store_runs(device_pages, store_pages, max(1, _STAGE_BYTES // self.page_bytes)):
                index = torch.tensor(dev, dtype=torch.long).to(self.device, non_blocking=pin)
                if direction is Direction.SAVE:
                    self.pages[h:h + n].copy_(self.arena.index_select(0, index), non_blocking=pin)
                else:
                    self.arena.index_copy_(0, index, self.pages[h:h + n].to(self.device, non_blocking=pin))


# The device buffer one run goes through: large enough to copy at PCIe's speed, small beside the pool.
_STAGE_BYTES = 64 << 20


def _store_runs(device_pages: list[int], store_pages: list[int], limit: int) -> list[tuple[list[int], int, int]]:
    """(device pages, first store page, length) of runs of consecutive store pages, at most `limit` long."""
    out: list[tuple[list[int], int, int]] = []
    for d, h in zip(device_pages, store_pages):
        if out and out[-1][1] + out[-1][2] == h and out[-1][2] < limit:
            out[-1][0].append(d)
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append(([d], h, 1))
    return out
