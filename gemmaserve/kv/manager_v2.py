"""V2: the sliding-window-aware KV cache manager.

One pool of equal-size pages serves every layer group (see groups.py). Per sequence and group, a
block table holds only *live* blocks: full-attention groups keep every block; a sliding group keeps
the blocks a later query can still read and gives the rest back after every step.

    sliding group, W = 8, T = 4, after computing 21 tokens (next query at position 21 sees 14..21):
    blocks    0      1      2      3      4      5
    tokens  0..3   4..7   8..11  12..15 16..19 20..21
    held     -      -      -     [s3]   [s4]   [s5]       (blocks 0-2 went back to the pool / cache)

Scratch reuse (chunked prefill): a block that no later query reads once the chunk is done only
lives while each layer computes its own attention over the chunk. Such blocks get a *scratch slot*
(every layer of the group -> one page) instead of one page per layer:

    chunk [0, 32), W = 8, T = 4: blocks 0-4 are out of the window at position 28 (the last block
    edge before the chunk end, where a later request may hit) -> 5 scratch pages shared by all layers
    of the group; blocks 5-7 are real (one page per layer). Peak for the group: 5 + 3 x layers pages
    instead of 8 x layers.

Pinned split (a benchmark knob, `sliding_share`): sliding groups may hold at most that share of the
pool and full groups the rest, as engines with one pool per life cycle do. It emulates the pinned
pool ratios seed 004 measures; the engine itself never sets it (one pool, no ratio to guess).

Prefix reuse: full blocks are registered under a hash chain of their tokens. A cache hit at m
tokens needs every block of full groups below m, and for sliding groups only the blocks the query
at m reads (the window tail). Scratch blocks have no pages to keep, but the window at every chunk
end and at the end of the prompt is real, so a repeated or extended prompt hits there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from .base import GroupStats, KVCacheManager, KVLayout, KVStats
from .block_hash import chain_root, extend_chain
from .groups import KVGroup, derive_groups
from .page_pool import PagePool
from .prefix_cache import PrefixCache
from .slots import Slot, SlotRows
from .spec import LayerSpec


@dataclass
class _BlockTable:
    first: int = 0                                   # logical block index of slots[0]
    slots: list[Slot] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)    # slots[i].row, kept in step (what attention reads)
    registered: int = 0                              # blocks below this were offered to the prefix cache

    def append(self, slot: Slot) -> None:
        self.slots.append(slot)
        self.rows.append(slot.row)

    def drop_front(self, n: int) -> list[Slot]:
        dropped = self.slots[:n]
        del self.slots[:n]
        del self.rows[:n]
        self.first += n
        return dropped

    @property
    def end(self) -> int:
        return self.first + len(self.slots)


@dataclass
class _Seq:
    tables: list[_BlockTable]
    num_computed: int = 0
    chain: list[bytes] = field(default_factory=list)
    room: int = 0        # tokens [0, room) have pages in every group: allocating below it is a no-op
    pages: int = 0       # pages of the slots in its tables (shared prefix hits included)
    next_event: int = 0  # the first position where a commit registers a block or drops a stale one


class KVCacheManagerV2(KVCacheManager):
    name = "v2"

    def __init__(self, specs: list[LayerSpec], page_size: int, num_pages: int, *,
                 enable_prefix_caching: bool = True, enable_scratch: bool = False, salt: bytes | str = b"",
                 sliding_share: float | None = None):
        super().__init__(specs, page_size)
        geo = derive_groups(specs, page_size)
        self._groups = geo.groups
        self._layer_slot = geo.layer_slot
        self._granularity = geo.hash_granularity
        self._hit_step = math.lcm(*(g.tokens_per_page for g in geo.groups))  # hits land on every group's block edge
        tokens = tuple(geo.groups[g].tokens_per_page for g, _ in geo.layer_slot)
        self._layout = KVLayout(num_pages, geo.page_bytes, True, tokens)
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_scratch = enable_scratch
        self.pool = PagePool(num_pages)
        self.rows = [SlotRows(g.num_layers) for g in self._groups]
        self.cache = PrefixCache()
        self._seqs: dict[str, _Seq] = {}
        self._root = chain_root(salt)
        self._query_tokens = 0
        self._hit_tokens = 0
        self._caps: dict[bool, int] | None = None      # pinned split: most pages per side (sliding?)
        self._held = {True: 0, False: 0}               # pages in slots per side
        self._peak_memo: dict[tuple[int, int, tuple[bool, ...]], int] = {}
        if sliding_share is not None:
            self._caps = self._pinned_caps(sliding_share)

    def _pinned_caps(self, share: float) -> dict[bool, int]:
        if not 0.0 < share < 1.0:
            raise ValueError(f"sliding share of the pool must be in (0, 1), got {share}")
        if self.enable_prefix_caching:
            raise ValueError("a pinned pool split is a benchmark knob that needs prefix caching off")
        if {g.sliding for g in self._groups} != {True, False}:
            raise ValueError("a pinned pool split needs both sliding and full groups")
        sliding = int(self.pool.num_pages * share)
        return {True: sliding, False: self.pool.num_pages - sliding}

    # -- geometry -----------------------------------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        return self._groups

    @property
    def layer_slot(self) -> tuple[tuple[int, int], ...]:
        return self._layer_slot

    def peak_pages(self, num_tokens: int, chunk: int) -> int:
        """The most pages one sequence holds during any step, for every way the scheduler may cut it
        into steps of at most `chunk` tokens (starts anywhere, prefix hits included)."""
        return self._peak(num_tokens, chunk, (True, False))

    def pages_at(self, num_tokens: int) -> int:
        total = 0
        for g in self._groups:
            total += (g.num_blocks(num_tokens) - g.first_needed_block(num_tokens)) * g.num_layers
        return total

    def pages_held(self, seq_id: str) -> int:
        seq = self._seqs.get(seq_id)
        return 0 if seq is None else seq.pages

    def fits_ever(self, num_tokens: int, chunk: int) -> bool:
        if self._caps is None:
            return super().fits_ever(num_tokens, chunk)
        return all(self._peak(num_tokens, chunk, (side,)) <= cap for side, cap in self._caps.items())

    def _peak(self, num_tokens: int, chunk: int, sides: tuple[bool, ...]) -> int:
        span = min(chunk, num_tokens)
        key = (num_tokens, span, sides)
        if key not in self._peak_memo:
            if len(self._peak_memo) > 4096:
                self._peak_memo.clear()
            groups = [g for g in self._groups if g.sliding in sides]
            windows = [g.window for g in groups if g.sliding]
            if not windows:   # full groups only: every block, at the end
                peak = sum(g.num_blocks(num_tokens) * g.num_layers for g in groups)
            else:
                peak = max(sum(self._step_pages(g, s, min(s + span, num_tokens)) for g in groups)
                           for s in self._step_starts(max(windows), num_tokens, span))
            self._peak_memo[key] = peak
        return self._peak_memo[key]

    def _step_pages(self, g: KVGroup, start: int, end: int) -> int:
        """Pages group `g` holds while a step computes [start, end), as `allocate` plans it. Full
        groups: every block up to `end`. Sliding groups: the real blocks the query at `start` reads,
        then the new blocks, scratch where stale by the step's last hit point. A longer step never
        holds fewer pages, so steps of the most tokens from each start are the worst case."""
        end_block = g.num_blocks(end)
        if not g.sliding:
            return end_block * g.num_layers
        first_new = g.num_blocks(start)
        behind = first_new - g.first_needed_block(start)
        stale = 0
        if self.enable_scratch and end - start > 1:
            stale = max(0, min(g.first_needed_block((end - 1) // self._hit_step * self._hit_step), end_block)
                        - first_new)
        return (behind + end_block - first_new - stale) * g.num_layers + stale

    def _step_starts(self, window: int, num_tokens: int, span: int) -> list[int]:
        """Step starts that cover the maximum of the pages held. Once the window is full
        (start >= W - 1) and the step ends before the sequence does, sliding groups hold a number
        that is periodic in the start with period H (the hit step: every block edge, window edge and
        hit point moves by whole blocks) while full groups only grow, so the first W + 2H starts and
        the period before the last full-length step cover those; where steps end at the sequence's
        end, a later start only trades new blocks for nothing, so one period past it covers the rest."""
        h = self._hit_step
        head = range(0, min(num_tokens, window + 2 * h))
        tail = range(max(head.stop, num_tokens - span - h),
                     min(num_tokens, num_tokens - span + 2 * h + max(g.tokens_per_page for g in self._groups)))
        return [*head, *tail]

    # -- prefix lookup --------------------------------------------------------------------------
    def _block_key(self, chain: list[bytes], g: KVGroup, block: int) -> bytes:
        return chain[(block + 1) * g.tokens_per_page // self._granularity - 1]

    def _cached(self, chain: list[bytes], g: KVGroup, block: int) -> Slot | None:
        return self.cache.get(g.index, self._block_key(chain, g, block))

    def lookup(self, seq_id: str, token_ids: list[int], chain: list[bytes] | None = None) -> int:
        if not self.enable_prefix_caching or seq_id in self._seqs or len(token_ids) < 2:
            return 0
        limit = len(token_ids) - 1           # the last prompt token is always recomputed
        chain = [] if chain is None else chain
        extend_chain(chain, token_ids, self._granularity, self._root, limit)
        hit = limit - limit % self._hit_step
        for g in self._groups:               # full groups: every block below the hit point
            if g.sliding:
                continue
            n = 0
            while (n + 1) * g.tokens_per_page <= hit and self._cached(chain, g, n) is not None:
                n += 1
            hit = min(hit, n * g.tokens_per_page)
            hit -= hit % self._hit_step
        changed = True
        while changed and hit > 0:           # sliding groups: the window tail at the hit point
            changed = False
            for g in self._groups:
                missing = self._last_missing(chain, g, hit) if g.sliding else None
                while missing is not None and hit > 0:
                    # No hit point whose window still covers the missing block can work: jump below it.
                    hit = missing * g.tokens_per_page // self._hit_step * self._hit_step
                    missing = self._last_missing(chain, g, hit)
                    changed = True
        return hit

    def _last_missing(self, chain: list[bytes], g: KVGroup, hit: int) -> int | None:
        """The last block a query at `hit` reads that is not cached, or None."""
        for b in range(hit // g.tokens_per_page - 1, g.first_needed_block(hit) - 1, -1):
            if self._cached(chain, g, b) is None:
                return b
        return None

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, seq_id, token_ids, start, end, prefill, chain=None) -> bool:
        seq = self._seqs.get(seq_id)
        if seq is not None and end <= seq.room and start == seq.num_computed:
            return True   # the common decode step: the current blocks still have room
        new_seq = seq is None
        chain = [] if chain is None else chain   # a new sequence keeps it (and grows it) from here on
        if new_seq and start:
            extend_chain(chain, token_ids, self._granularity, self._root, start)
        elif not new_seq and start != seq.num_computed:
            raise ValueError(f"sequence {seq_id}: allocate from {start}, but {seq.num_computed} tokens are computed")
        scratch_ok = self.enable_scratch and prefill and end - start > 1
        keep = (end - 1) // self._hit_step * self._hit_step
        # Per group: the blocks reused from the cache (new sequences only), then fresh blocks.
        plan: list[tuple[int, list[Slot], list[bool]]] = []    # (first block, hits, fresh-is-scratch)
        need = reviving = 0
        side_need = {True: 0, False: 0}
        for g in self._groups:
            if new_seq:
                first = g.first_needed_block(start)
                hits = [self._cached(chain, g, b) for b in range(first, start // g.tokens_per_page)]
                if any(s is None for s in hits):
                    raise ValueError(f"sequence {seq_id}: {start} tokens are not cached (call lookup first)")
                next_block = start // g.tokens_per_page
            else:
                table = seq.tables[g.index]
                first, hits, next_block = table.first, [], table.end
            # Scratch: blocks no query reads after this chunk. Blocks the window of the last hit point
            # inside the chunk (`keep`) reads stay real, so the chunk end can be a prefix hit later
            # (the last prompt token is always recomputed, so a repeated prompt hits just before it).
            stale_at_end = g.first_needed_block(keep) if scratch_ok and g.sliding else 0
            fresh = [b < stale_at_end for b in range(next_block, g.num_blocks(end))]
            pages = sum(1 if scratch else g.num_layers for scratch in fresh)
            need += pages
            side_need[g.sliding] += pages
            reviving += sum(len(s.pages) for s in hits if self.cache.is_parked(s))
            plan.append((first, hits, fresh))
        if self.pool.num_free + self.cache.evictable_pages - reviving < need:
            return False
        if self._caps is not None and any(self._held[side] + side_need[side] > cap for side, cap in self._caps.items()):
            return False
        for _, hits, _ in plan:
            for slot in hits:
                self._take(slot)
        while self.pool.num_free < need:
            self._destroy(self.cache.evict_oldest())
        if new_seq:
            seq = _Seq([_BlockTable(first, list(hits), [h.row for h in hits], start // g.tokens_per_page)
                        for g, (first, hits, _) in zip(self._groups, plan)], start, chain)
            seq.pages = sum(len(s.pages) for _, hits, _ in plan for s in hits)
            self._seqs[seq_id] = seq
        for g, (_, _, fresh) in zip(self._groups, plan):
            for scratch in fresh:
                slot = self.rows[g.index].add(g.index, self.pool.allocate(1 if scratch else g.num_layers), scratch)
                self._held[g.sliding] += len(slot.pages)
                seq.pages += len(slot.pages)
                slot.ref = 1
                seq.tables[g.index].append(slot)
                if scratch:
                    seq.next_event = 0   # the next commit must free it
        seq.room = min(t.end * g.tokens_per_page for g, t in zip(self._groups, seq.tables))
        return True

    def allocate_computed(self, seq_id, token_ids, num_computed) -> bool:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already holds pages")
        spans = [(g.first_needed_block(num_computed), g.num_blocks(num_computed)) for g in self._groups]
        side_need = {True: 0, False: 0}
        for g, (first, end) in zip(self._groups, spans):
            side_need[g.sliding] += (end - first) * g.num_layers
        need = sum(side_need.values())
        if self.pool.num_free + self.cache.evictable_pages < need:
            return False
        if self._caps is not None and any(self._held[side] + side_need[side] > cap for side, cap in self._caps.items()):
            return False
        while self.pool.num_free < need:
            self._destroy(self.cache.evict_oldest())
        # registered = end: the received blocks never enter the prefix cache.
        seq = _Seq([_BlockTable(first, registered=end) for first, end in spans], num_computed)
        for g, (first, end) in zip(self._groups, spans):
            for _ in range(first, end):
                slot = self.rows[g.index].add(g.index, self.pool.allocate(g.num_layers), False)
                slot.ref = 1
                self._held[g.sliding] += len(slot.pages)
                seq.pages += len(slot.pages)
                seq.tables[g.index].append(slot)
        seq.room = min(t.end * g.tokens_per_page for g, t in zip(self._groups, seq.tables))
        self._seqs[seq_id] = seq
        return True

    def record_prefix_query(self, query_tokens: int, hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self._query_tokens += query_tokens
            self._hit_tokens += hit_tokens

    def reset_prefix_cache(self) -> None:
        while self.cache.evictable_pages:
            self._destroy(self.cache.evict_oldest())
        self._query_tokens = self._hit_tokens = 0

    def _take(self, slot: Slot) -> None:
        if slot.ref == 0:
            self.cache.revive(slot)
        slot.ref += 1

    def _release(self, slot: Slot) -> None:
        slot.ref -= 1
        if slot.ref > 0:
            return
        if slot.key is not None and self.enable_prefix_caching:
            self.cache.park(slot)
        else:
            self._destroy(slot)

    def _destroy(self, slot: Slot) -> None:
        self.rows[slot.group].remove(slot)
        self._held[self._groups[slot.group].sliding] -= len(slot.pages)
        self.pool.free(list(slot.pages))

    # -- after a step ---------------------------------------------------------------------------
    def commit(self, seq_id, token_ids, num_computed) -> None:
        seq = self._seqs[seq_id]
        seq.num_computed = num_computed
        if num_computed < seq.next_event:
            return   # no block filled up, none left every window, no scratch to free
        self._commit(seq, token_ids, num_computed)

    def _commit(self, seq: _Seq, token_ids: list[int], num_computed: int) -> None:
        if self.enable_prefix_caching:
            extend_chain(seq.chain, token_ids, self._granularity, self._root, num_computed)
            for g in self._groups:
                table = seq.tables[g.index]
                full = num_computed // g.tokens_per_page
                for b in range(max(table.registered, table.first), min(full, table.end)):
                    slot = table.slots[b - table.first]
                    if not slot.scratch and slot.key is None:
                        self.cache.register(slot, self._block_key(seq.chain, g, b))
                table.registered = max(table.registered, full)
        for g in self._groups:
            if not g.sliding:
                continue
            table = seq.tables[g.index]
            drop = min(g.first_needed_block(num_computed), table.end) - table.first
            if drop > 0:
                for slot in table.drop_front(drop):
                    seq.pages -= len(slot.pages)
                    self._release(slot)
        seq.next_event = min(self._next_event(g, num_computed) for g in self._groups)

    def _next_event(self, g: KVGroup, num_computed: int) -> int:
        """The smallest position > num_computed where a block of `g` fills up (to register) or,
        for a sliding group, the first block leaves the window."""
        t = g.tokens_per_page
        nxt = (num_computed // t + 1) * t if self.enable_prefix_caching else 1 << 62
        if g.sliding:
            # first_needed_block(p) grows when p - W + 1 reaches the next multiple of t
            first = g.first_needed_block(num_computed)
            nxt = min(nxt, (first + 1) * t + g.window - 1)
        return nxt

    def free(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for table in seq.tables:
            for slot in reversed(table.slots):   # the tail is parked first, so it is evicted first
                self._release(slot)

    # -- views ----------------------------------------------------------------------------------
    def block_table(self, seq_id: str, group: int) -> tuple[int, list[int]]:
        table = self._seqs[seq_id].tables[group]
        return table.first, table.rows

    def slot_changes(self, group: int, cursor: int) -> tuple[list[int] | None, int]:
        return self.rows[group].changes_since(cursor)

    def slot_rows(self, group: int, rows: list[int] | None) -> tuple[list[int], list[list[int]]]:
        table = self.rows[group]
        rows = sorted(table.live) if rows is None else rows
        return rows, table.table[rows].tolist()

    def held_blocks(self, seq_id: str) -> list[tuple[int, int]]:
        """Per group: (first live block, number of live blocks) of a sequence."""
        return [(t.first, len(t.slots)) for t in self._seqs[seq_id].tables]

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free + self.cache.evictable_pages

    def stats(self) -> KVStats:
        per_group = []
        for g in self._groups:
            used = cached = scratch = 0
            for slot in self.rows[g.index].live.values():
                if slot.ref > 0:
                    used += len(slot.pages)
                    scratch += len(slot.pages) if slot.scratch else 0
                else:
                    cached += len(slot.pages)
            per_group.append(GroupStats(g.index, g.kind.value, g.window, g.num_layers, g.tokens_per_page,
                                        used, cached, scratch))
        used = sum(s.pages_used for s in per_group)
        cached = sum(s.pages_cached for s in per_group)
        return KVStats(self.num_pages, self.page_bytes, self.pool.num_free, used, cached,
                       sum(s.scratch_pages for s in per_group), tuple(per_group), self._query_tokens,
                       self._hit_tokens)

    def check_integrity(self) -> None:
        for _ in self.integrity_steps():
            pass

    def integrity_steps(self) -> Iterator[None]:
        """check_integrity() in slices: it yields every few hundred slots, so an idle engine can stop
        checking the moment work arrives (and start over at the next idle)."""
        page_owner: dict[int, Slot] = {}
        refs: dict[int, int] = {}
        done = 0
        for g, rows in zip(self._groups, self.rows):
            for row, slot in rows.live.items():
                done += 1
                if done % 256 == 0:
                    yield
                assert slot.row == row and slot.group == g.index, f"slot row/group mismatch at {g.index}:{row}"
                assert len(slot.pages) == (1 if slot.scratch else g.num_layers), "slot page count"
                for p in slot.pages:
                    assert p not in page_owner, f"page {p} is in two slots"
                    assert not self.pool.is_free(p), f"page {p} is in a slot and on the free list"
                    page_owner[p] = slot
                expect = list(slot.pages) * g.num_layers if slot.scratch else list(slot.pages)
                assert rows.table[row].tolist() == expect, f"slot_pages row {row} of group {g.index} is stale"
                assert slot.ref >= 0
                if slot.ref == 0:
                    assert slot.key is not None and self.cache.is_parked(slot), "unreferenced slot not cached"
                    assert not slot.scratch, "a scratch slot outlived its step"
        for seq_id, seq in self._seqs.items():
            for g, table in zip(self._groups, seq.tables):
                assert table.rows == [slot.row for slot in table.slots], f"{seq_id}: row list out of step"
                for slot in table.slots:
                    assert slot.group == g.index and slot.row in self.rows[g.index].live, f"{seq_id}: dead slot"
                    assert not slot.scratch, f"{seq_id}: scratch slot held between steps"
                    refs[id(slot)] = refs.get(id(slot), 0) + 1
                if g.sliding and table.slots:
                    first_needed = g.first_needed_block(seq.num_computed)
                    assert table.first >= first_needed, (
                        f"{seq_id}: sliding group {g.index} holds block {table.first}, out of every window "
                        f"(first needed {first_needed})")
                # Complete: every block the next query reads is there.
                assert table.first <= g.first_needed_block(seq.num_computed), f"{seq_id}: group {g.index} lost blocks"
                assert table.end >= g.num_blocks(seq.num_computed), f"{seq_id}: group {g.index} misses its tail"
                # A cached block's key is the hash of this sequence's tokens up to it.
                for b, slot in enumerate(table.slots, table.first):
                    if slot.key is not None and (b + 1) * g.tokens_per_page // self._granularity <= len(seq.chain):
                        assert slot.key == self._block_key(seq.chain, g, b), f"{seq_id}: block {b} has another's key"
            assert seq.pages == sum(len(s.pages) for t in seq.tables for s in t.slots), f"{seq_id}: page count"
            yield
        for rows in self.rows:
            for slot in rows.live.values():
                assert slot.ref == refs.get(id(slot), 0), f"slot ref {slot.ref} != {refs.get(id(slot), 0)} holders"
            yield
        for slot in self.cache.parked():
            assert slot.ref == 0 and slot.row in self.rows[slot.group].live, "parked slot is referenced or dead"
        for slot in self.cache.registered():
            assert self.cache.get(slot.group, slot.key) is slot, "cache key map inconsistent"
        assert self.cache.evictable_pages == sum(len(s.pages) for s in self.cache.parked())
        for side in (True, False):
            held = sum(self._groups[s.group].sliding == side for s in page_owner.values())   # one entry per page
            assert self._held[side] == held, f"{self._held[side]} pages counted on one side, {held} held"
            assert self._caps is None or held <= self._caps[side], "a pinned side exceeds its share"
        assert len(page_owner) + self.pool.num_free == self.num_pages, (
            f"{len(page_owner)} pages in slots + {self.pool.num_free} free != {self.num_pages}")


def pinned_pool_split(specs: list[LayerSpec], page_size: int, expected_len: int) -> float:
    """The sliding groups' share of the pages that sequences of `expected_len` tokens hold (the
    live blocks of each group at that length): the ratio a per-life-cycle pool sizing recipe pins
    for that expected input length."""
    geo = derive_groups(specs, page_size)
    pages = {True: 0, False: 0}
    for g in geo.groups:
        live = g.num_blocks(expected_len + 1) - g.first_needed_block(expected_len)
        pages[g.sliding] += live * g.num_layers
    return pages[True] / (pages[True] + pages[False])
