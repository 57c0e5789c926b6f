"""V1: every layer keeps every token (the baseline V2 is measured against).

One group holds every layer as if it were full attention; a slot is one page id that indexes every
layer's own storage, so a page costs T x (sum over layers of bytes per token).

    seq "a", 37 tokens, T = 16        block table: [7, 2, 9]
    layer 0   [7: t0..t15][2: t16..t31][9: t32..t36 ....]
    layer 1   [7: t0..t15][2: t16..t31][9: t32..t36 ....]
    ...
"""

from __future__ import annotations

from .base import GroupStats, KVCacheManager, KVLayout, KVStats
from .groups import KVGroup
from .page_pool import PagePool
from .spec import AttentionKind, LayerSpec


class KVCacheManagerV1(KVCacheManager):
    name = "v1"

    def __init__(self, specs: list[LayerSpec], page_size: int, num_pages: int):
        super().__init__(specs, page_size)
        owners = tuple(i for i, s in enumerate(specs) if s.owns_kv)
        self._group = KVGroup(0, AttentionKind.FULL, None, page_size, owners)
        col = {layer: c for c, layer in enumerate(owners)}
        self._layer_slot = tuple((0, col[i if s.owns_kv else s.kv_source]) for i, s in enumerate(specs))
        self._layout = KVLayout(num_pages, self.page_bytes_for(specs, page_size), False,
                                tuple(page_size for _ in specs), identity_slots=True)
        self.pool = PagePool(num_pages)
        self._held: dict[str, list[int]] = {}   # hold_pages
        self._tables: dict[str, list[int]] = {}

    @staticmethod
    def page_bytes_for(specs: list[LayerSpec], page_size: int) -> int:
        return page_size * sum(s.bytes_per_token() for s in specs)

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        return (self._group,)

    @property
    def layer_slot(self) -> tuple[tuple[int, int], ...]:
        return self._layer_slot

    def peak_pages(self, num_tokens: int, chunk: int) -> int:
        return self._group.num_blocks(num_tokens)

    def pages_at(self, num_tokens: int) -> int:
        return self._group.num_blocks(num_tokens)

    def pages_held(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ()))

    def allocate(self, seq_id, token_ids, start, end, prefill, chain=None) -> bool:
        table = self._tables.setdefault(seq_id, [])
        missing = self._group.num_blocks(end) - len(table)
        if missing <= 0:
            return True
        pages = self.pool.allocate(missing)
        if pages is None:
            if not table:
                del self._tables[seq_id]
            return False
        table.extend(pages)
        return True

    def allocate_computed(self, seq_id, token_ids, num_computed) -> bool:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds pages")
        pages = self.pool.allocate(self._group.num_blocks(num_computed))
        if pages is None:
            return False
        self._tables[seq_id] = pages
        return True

    def free(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if table:
            self.pool.free(table)

    def block_table(self, seq_id: str, group: int) -> tuple[int, list[int]]:
        return 0, self._tables[seq_id]

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    def hold_pages(self, key: str, n: int) -> int:
        pages = self.pool.allocate(min(n, self.pool.num_free))
        self._held.setdefault(key, []).extend(pages)
        return len(pages)

    def release_held(self, key: str) -> None:
        self.pool.free(self._held.pop(key, []))

    def stats(self) -> KVStats:
        free = self.pool.num_free
        used = self.num_pages - free
        g = self._group
        return KVStats(self.num_pages, self.page_bytes, free, used, 0, 0,
                       (GroupStats(0, g.kind.value, None, g.num_layers, g.tokens_per_page, used, 0, 0),), 0, 0)

    def check_integrity(self) -> None:
        owner: dict[int, str] = {}
        for seq_id, table in self._tables.items():
            assert table, f"sequence {seq_id} holds an empty table"
            for p in table:
                assert 0 <= p < self.num_pages, f"page {p} of {seq_id} is out of range"
                assert p not in owner, f"page {p} owned by both {owner[p]} and {seq_id}"
                assert not self.pool.is_free(p), f"page {p} of {seq_id} is also on the free list"
                owner[p] = seq_id
        held = [p for pages in self._held.values() for p in pages]
        assert not set(held) & owner.keys() and not any(self.pool.is_free(p) for p in held), "a held page is in use"
        assert len(owner) + len(held) + self.pool.num_free == self.num_pages, (
            f"{len(owner)} owned + {len(held)} held + {self.pool.num_free} free != {self.num_pages} pages")
