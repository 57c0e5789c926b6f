"""V1: every layer keeps every token (the baseline V2 is measured against).

One page table per sequence, shared by all layers: page p holds tokens [i*P, (i+1)*P) of the
sequence in *every* layer, so one page costs P x (sum over layers of bytes per token).

    seq "a", 37 tokens, P = 16        table: [7, 2, 9]
    layer 0   [7: t0..t15][2: t16..t31][9: t32..t36 ....]
    layer 1   [7: t0..t15][2: t16..t31][9: t32..t36 ....]
    ...
"""

from __future__ import annotations

from .base import KVCacheManager, KVStats
from .page_pool import PagePool
from .spec import LayerSpec


class KVCacheManagerV1(KVCacheManager):
    def __init__(self, specs: list[LayerSpec], page_size: int, num_pages: int):
        super().__init__(specs, page_size, num_pages)
        self.pool = PagePool(num_pages)
        self._tables: dict[str, list[int]] = {}

    @staticmethod
    def page_bytes_for(specs: list[LayerSpec], page_size: int) -> int:
        return page_size * sum(s.bytes_per_token() for s in specs)

    @property
    def layer_table(self) -> list[int]:
        return [0] * len(self.specs)

    @property
    def num_tables(self) -> int:
        return 1

    @property
    def page_bytes(self) -> int:
        return self.page_bytes_for(self.specs, self.page_size)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        table = self._tables.setdefault(seq_id, [])
        missing = self.pages_for(num_tokens) - len(table)
        if missing <= 0:
            return True
        pages = self.pool.allocate(missing)
        if pages is None:
            if not table:
                del self._tables[seq_id]
            return False
        table.extend(pages)
        return True

    def free(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if table:
            self.pool.free(table)

    def page_table(self, seq_id: str, table: int = 0) -> list[int]:
        if table != 0:
            raise IndexError(f"V1 has one page table, asked for table {table}")
        return self._tables[seq_id]

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    def stats(self) -> KVStats:
        free = self.pool.num_free
        return KVStats(self.num_pages, self.num_pages - free, free, self.page_size, self.page_bytes)

    def check_integrity(self) -> None:
        owner: dict[int, str] = {}
        for seq_id, table in self._tables.items():
            assert table, f"sequence {seq_id} holds an empty table"
            for p in table:
                assert 0 <= p < self.num_pages, f"page {p} of {seq_id} is out of range"
                assert p not in owner, f"page {p} owned by both {owner[p]} and {seq_id}"
                assert not self.pool.is_free(p), f"page {p} of {seq_id} is also on the free list"
                owner[p] = seq_id
        assert len(owner) + self.pool.num_free == self.num_pages, (
            f"{len(owner)} owned + {self.pool.num_free} free != {self.num_pages} pages")
