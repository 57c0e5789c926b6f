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

What differs between attention kinds (which blocks a step needs, which it frees, what a prefix hit
needs) is each group's policy (policy.py); this file only books slots and pages.

Prefix reuse: full blocks are registered under a hash chain of their tokens. A cache hit at m
tokens needs every block of full groups below m, and for sliding groups only the blocks the query
at m reads (the window tail). Scratch blocks have no pages to keep, but the window at every chunk
end and at the end of the prompt is real, so a repeated or extended prompt hits there.

Host tier (host_tier.py, optional): a block the prefix cache evicts is copied to host memory first if a
resumption would read it: every block of a full group; of a sliding group, only blocks in the window tail
of a prefill chunk's end or a sequence's end (`Slot.tail`), the points where a later request resumes;
KV-shared layers own no pages, so nothing of theirs. A lookup counts a block found in either place; an
allocation gives a stored block fresh pages and asks the runner to copy it back before the forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from .base import GroupStats, KVCacheManager, KVLayout, KVStats
from .block_hash import chain_root, extend_chain, root_of
from .connector import KVTransfers
from .groups import KVGroup, derive_groups
from .host_tier import HostBlock, HostTier
from .page_pool import PagePool
from .policy import NEVER, GroupPolicy, policy_for
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
                 lookback: int = 0, offload_pages: int = 0):
        """`lookback`: tokens behind the newest position whose keys sliding groups keep beyond their
        window (policy.py: consumers that query behind the writer). `offload_pages`: pages of a host tier
        that keeps what the prefix cache evicts (0: none)."""
        super().__init__(specs, page_size)
        geo = derive_groups(specs, page_size)
        self._groups = geo.groups
        self.policies: tuple[GroupPolicy, ...] = tuple(policy_for(g, lookback) for g in geo.groups)
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
        self._peak_memo: dict[tuple[int, int, tuple[int, ...]], int] = {}
        if offload_pages and not enable_prefix_caching:
            raise ValueError("a host KV tier keeps what the prefix cache evicts: it needs prefix caching")
        self.tier = HostTier(offload_pages, geo.page_bytes) if offload_pages else None
        self._held: dict[str, list[int]] = {}   # hold_pages

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
        return self._peak(num_tokens, chunk, tuple(range(len(self._groups))))

    def pages_at(self, num_tokens: int) -> int:
        return sum(len(p.needed_blocks(num_tokens)) * p.group.num_layers for p in self.policies)

    def pages_held(self, seq_id: str) -> int:
        seq = self._seqs.get(seq_id)
        return 0 if seq is None else seq.pages

    def _peak(self, num_tokens: int, chunk: int, groups: tuple[int, ...]) -> int:
        """peak_pages over the groups with these indices."""
        span = min(chunk, num_tokens)
        key = (num_tokens, span, groups)
        if key not in self._peak_memo:
            if len(self._peak_memo) > 4096:
                self._peak_memo.clear()
            policies = [self.policies[g] for g in groups]
            reaches = [p.reach for p in policies if p.drops_blocks]
            if not reaches:   # nothing drops: every block, at the end
                peak = sum(p.group.num_blocks(num_tokens) * p.group.num_layers for p in policies)
            else:
                peak = max(sum(self._step_pages(p, s, min(s + span, num_tokens)) for p in policies)
                           for s in self._step_starts(max(reaches), num_tokens, span))
            self._peak_memo[key] = peak
        return self._peak_memo[key]

    def _step_pages(self, policy: GroupPolicy, start: int, end: int) -> int:
        """Pages a group holds while a step computes [start, end), as `allocate` plans it: the blocks
        the query at `start` reads, then the new blocks, scratch where stale by the step's last hit
        point. A longer step never holds fewer pages, so steps of the most tokens from each start are
        the worst case."""
        keep = (end - 1) // self._hit_step * self._hit_step if self.enable_scratch and end - start > 1 else None
        b = policy.step_blocks(start, end, keep)
        return (b.held_before + b.new - b.scratch) * policy.group.num_layers + b.scratch

    def _step_starts(self, window: int, num_tokens: int, span: int) -> list[int]:
        """Step starts that cover the maximum of the pages held. Once the window (plus lookback) is
        full (start >= W - 1) and the step ends before the sequence does, sliding groups hold a number
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

    def _found(self, chain: list[bytes], g: KVGroup, block: int) -> Slot | HostBlock | None:
        """The block's cached slot on the device, else its copy in the host tier, else None."""
        slot = self._cached(chain, g, block)
        if slot is None and self.tier is not None:
            return self.tier.get(g.index, self._block_key(chain, g, block))
        return slot

    def lookup(self, seq_id: str, token_ids: list[int], chain: list[bytes] | None = None) -> int:
        if not self.enable_prefix_caching or seq_id in self._seqs or len(token_ids) < 2:
            return 0
        limit = len(token_ids) - 1           # the last prompt token is always recomputed
        chain = [] if chain is None else chain
        extend_chain(chain, token_ids, self._granularity, root_of(chain, self._root), limit)
        hit = limit - limit % self._hit_step
        changed = True
        while changed and hit > 0:   # a group that lowers the hit point may leave another without its blocks
            changed = False
            for p in self.policies:
                h = self._group_hit(chain, p, hit)
                changed |= h < hit
                hit = h
        return hit

    def _group_hit(self, chain: list[bytes], policy: GroupPolicy, hit: int) -> int:
        """The highest hit point <= `hit` (a multiple of the hit step) whose blocks `policy` needs
        are all cached."""
        g = policy.group
        while hit > 0:
            blocks = policy.hit_blocks(hit)
            if not policy.drops_blocks:   # every block from 0: the first missing one bounds the hit
                missing = next((b for b in blocks if self._found(chain, g, b) is None), None)
                if missing is None:
                    return hit
                return missing * g.tokens_per_page // self._hit_step * self._hit_step
            # A window tail: no hit point whose window still covers the last missing block can work,
            # so jump below it and look again.
            missing = next((b for b in reversed(blocks) if self._found(chain, g, b) is None), None)
            if missing is None:
                return hit
            hit = missing * g.tokens_per_page // self._hit_step * self._hit_step
        return 0

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, seq_id, token_ids, start, end, prefill, chain=None) -> bool:
        seq = self._seqs.get(seq_id)
        if seq is not None and end <= seq.room and start == seq.num_computed:
            return True   # the common decode step: the current blocks still have room
        new_seq = seq is None
        chain = [] if chain is None else chain   # a new sequence keeps it (and grows it) from here on
        if new_seq and start:
            extend_chain(chain, token_ids, self._granularity, root_of(chain, self._root), start)
        elif not new_seq and start != seq.num_computed:
            raise ValueError(f"sequence {seq_id}: allocate from {start}, but {seq.num_computed} tokens are computed")
        scratch_ok = self.enable_scratch and prefill and end - start > 1
        keep = (end - 1) // self._hit_step * self._hit_step
        # Per group: the blocks reused from the cache (new sequences only), then fresh blocks.
        plan: list[tuple[int, list[Slot | HostBlock], list[bool]]] = []    # (first block, hits, fresh-is-scratch)
        need: list[int] = []   # fresh pages per group (blocks copied back from the host tier included)
        reviving = 0
        for g, policy in zip(self._groups, self.policies):
            if new_seq:
                blocks = policy.hit_blocks(start)
                first = blocks.start
                hits = [self._found(chain, g, b) for b in blocks]
                if any(s is None for s in hits):
                    raise ValueError(f"sequence {seq_id}: {start} tokens are not cached (call lookup first)")
                next_block = start // g.tokens_per_page
            else:
                table = seq.tables[g.index]
                first, hits, next_block = table.first, [], table.end
            # Scratch: blocks no query reads after this chunk. Blocks the window of the last hit point
            # inside the chunk (`keep`) reads stay real, so the chunk end can be a prefix hit later
            # (the last prompt token is always recomputed, so a repeated prompt hits just before it).
            stale_at_end = policy.scratch_below(keep) if scratch_ok else 0
            fresh = [b < stale_at_end for b in range(next_block, g.num_blocks(end))]
            need.append(sum(1 if scratch else g.num_layers for scratch in fresh)
                        + sum(g.num_layers for s in hits if isinstance(s, HostBlock)))
            reviving += sum(len(s.pages) for s in hits if isinstance(s, Slot) and self.cache.is_parked(s))
            plan.append((first, hits, fresh))
        if not self._has_room(need, reviving):
            return False
        for _, hits, _ in plan:
            for hit in hits:
                if isinstance(hit, Slot):
                    self._take(hit)
                else:
                    self.tier.pin(hit)   # no save made room by evicting it before its load below
        while self.pool.num_free < sum(need):
            self._evict_one()
        if new_seq:
            slots = [[self._restore(hit, chain, g, b) for b, hit in enumerate(hits, first)]
                     for g, (first, hits, _) in zip(self._groups, plan)]
            seq = _Seq([_BlockTable(first, held, [h.row for h in held], start // g.tokens_per_page)
                        for g, (first, _, _), held in zip(self._groups, plan, slots)], start, chain)
            seq.pages = sum(len(s.pages) for held in slots for s in held)
            self._seqs[seq_id] = seq
        for g, (_, _, fresh) in zip(self._groups, plan):
            for scratch in fresh:
                slot = self.rows[g.index].add(g.index, self.pool.allocate(1 if scratch else g.num_layers), scratch)
                seq.pages += len(slot.pages)
                slot.ref = 1
                seq.tables[g.index].append(slot)
                if scratch:
                    seq.next_event = 0   # the next commit must free it
        seq.room = min(t.end * g.tokens_per_page for g, t in zip(self._groups, seq.tables))
        if prefill and end - start > 1 and self.tier is not None:
            self._mark_tail(seq, keep)
        return True

    def _restore(self, hit: Slot | HostBlock, chain: list[bytes], g: KVGroup, block: int) -> Slot:
        """A hit's slot: a device one as it is (already taken), or fresh pages the runner fills from the host
        tier before the forward, cached under the block's key at once (its content is known)."""
        if isinstance(hit, Slot):
            return hit
        slot = self.rows[g.index].add(g.index, self.pool.allocate(g.num_layers), False)
        slot.ref = 1
        slot.tail = self.policies[g.index].drops_blocks
        self.tier.load(hit, slot.pages)
        self.cache.register(slot, self._block_key(chain, g, block))
        return slot

    def _mark_tail(self, seq: _Seq, hit: int) -> None:
        """Flag the sliding blocks a request resuming at `hit` reads, held or parked, as worth a host copy."""
        for g, policy, table in zip(self._groups, self.policies, seq.tables):
            if not policy.drops_blocks or hit <= 0:
                continue
            for b in policy.hit_blocks(hit):
                if table.first <= b < table.end:
                    table.slots[b - table.first].tail = True
                elif (b + 1) * g.tokens_per_page // self._granularity <= len(seq.chain):
                    slot = self._cached(seq.chain, g, b)
                    if slot is not None:
                        slot.tail = True

    def _evict_one(self) -> None:
        """Give the least recently used cached slot's pages back, keeping a host copy where one is worth it."""
        slot, key = self.cache.evict_oldest()
        if self.tier is not None and (slot.tail or not self.policies[slot.group].drops_blocks):
            self.tier.save(slot.group, key, slot.pages)
        self._destroy(slot)

    def hold_pages(self, key: str, n: int) -> int:
        while self.pool.num_free < n and self.cache.evictable_pages:
            self._evict_one()
        pages = self.pool.allocate(min(n, self.pool.num_free))
        self._held.setdefault(key, []).extend(pages)
        return len(pages)

    def release_held(self, key: str) -> None:
        self.pool.free(self._held.pop(key, []))

    def take_transfers(self) -> KVTransfers | None:
        return self.tier.take() if self.tier is not None else None

    def allocate_computed(self, seq_id, token_ids, num_computed) -> bool:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already holds pages")
        spans = [p.needed_blocks(num_computed) for p in self.policies]
        need = [len(span) * g.num_layers for g, span in zip(self._groups, spans)]
        if not self._has_room(need, 0):
            return False
        while self.pool.num_free < sum(need):
            self._evict_one()
        # registered = end: `cache_computed` offers the received blocks once their bytes are on their way.
        seq = _Seq([_BlockTable(span.start, registered=span.stop) for span in spans], num_computed)
        for g, span in zip(self._groups, spans):
            for _ in span:
                slot = self.rows[g.index].add(g.index, self.pool.allocate(g.num_layers), False)
                slot.ref = 1
                seq.pages += len(slot.pages)
                seq.tables[g.index].append(slot)
        seq.room = min(t.end * g.tokens_per_page for g, t in zip(self._groups, seq.tables))
        self._seqs[seq_id] = seq
        return True

    def cache_computed(self, seq_id: str, token_ids: list[int], chain: list[bytes] | None = None) -> int:
        """Enter the blocks of an `allocate_computed` sequence that every sender fills whole (transfer/plan.py:
        full groups from token 0, sliding groups the window tail before the query) into the prefix cache; the
        caller has planned their copy before any later forward. Returns how many."""
        seq = self._seqs[seq_id]
        if not self.enable_prefix_caching:
            return 0
        if chain is not None and not seq.chain:   # the sequence keeps (and grows) the request's chain
            seq.chain = chain
        n = seq.num_computed
        extend_chain(seq.chain, token_ids, self._granularity, root_of(seq.chain, self._root), n)
        added = 0
        for g, policy, table in zip(self._groups, self.policies, seq.tables):
            filled_from = max(0, n - g.window + 1) if policy.drops_blocks else 0
            for b, slot in enumerate(table.slots, table.first):
                if b * g.tokens_per_page >= filled_from and (b + 1) * g.tokens_per_page <= n and slot.key is None:
                    added += self.cache.register(slot, self._block_key(seq.chain, g, b))
        return added

    def _has_room(self, need: list[int], reviving: int) -> bool:
        """Whether the pool can give `need[g]` fresh pages to each group g while the cached slots a
        hit revives (`reviving` pages) stop being evictable."""
        return self.pool.num_free + self.cache.evictable_pages - reviving >= sum(need)

    def record_prefix_query(self, query_tokens: int, hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self._query_tokens += query_tokens
            self._hit_tokens += hit_tokens

    def reset_prefix_cache(self) -> None:
        while self.cache.evictable_pages:
            self._destroy(self.cache.evict_oldest()[0])
        if self.tier is not None:
            self.tier.clear()
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
            extend_chain(seq.chain, token_ids, self._granularity, root_of(seq.chain, self._root), num_computed)
            for g in self._groups:
                table = seq.tables[g.index]
                full = num_computed // g.tokens_per_page
                for b in range(max(table.registered, table.first), min(full, table.end)):
                    slot = table.slots[b - table.first]
                    if not slot.scratch and slot.key is None:
                        self.cache.register(slot, self._block_key(seq.chain, g, b))
                table.registered = max(table.registered, full)
        for policy, table in zip(self.policies, seq.tables):
            if not policy.drops_blocks:
                continue
            drop = min(policy.first_needed_block(num_computed), table.end) - table.first
            if drop > 0:
                for slot in table.drop_front(drop):
                    seq.pages -= len(slot.pages)
                    self._release(slot)
        seq.next_event = min(self._next_event(p, num_computed) for p in self.policies)

    def _next_event(self, policy: GroupPolicy, num_computed: int) -> int:
        """The smallest position > num_computed where a block of the group fills up (to register) or
        its first needed block moves on (to drop)."""
        t = policy.tokens_per_page
        fills = (num_computed // t + 1) * t if self.enable_prefix_caching else NEVER
        return min(fills, policy.next_drop(num_computed))

    def free(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if self.tier is not None:   # a later turn resumes at the end of this one
            self._mark_tail(seq, seq.num_computed // self._hit_step * self._hit_step)
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
        used = sum(s.pages_used for s in per_group) + sum(len(p) for p in self._held.values())
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
            for g, policy, table in zip(self._groups, self.policies, seq.tables):
                assert table.rows == [slot.row for slot in table.slots], f"{seq_id}: row list out of step"
                for slot in table.slots:
                    assert slot.group == g.index and slot.row in self.rows[g.index].live, f"{seq_id}: dead slot"
                    assert not slot.scratch, f"{seq_id}: scratch slot held between steps"
                    refs[id(slot)] = refs.get(id(slot), 0) + 1
                first_needed = policy.first_needed_block(seq.num_computed)
                if policy.drops_blocks and table.slots:
                    assert table.first >= first_needed, (
                        f"{seq_id}: group {g.index} holds block {table.first}, which no query reads any more "
                        f"(first needed {first_needed})")
                # Complete: every block the next query reads is there.
                assert seq.num_computed >= policy.rollback_floor(table.first), f"{seq_id}: group {g.index} lost blocks"
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
        if self.tier is not None:
            self.tier.check_integrity()
        held = [p for pages in self._held.values() for p in pages]
        assert not set(held) & page_owner.keys() and not any(self.pool.is_free(p) for p in held), "a held page is used"
        assert len(page_owner) + len(held) + self.pool.num_free == self.num_pages, (
            f"{len(page_owner)} pages in slots + {len(held)} held + {self.pool.num_free} free != {self.num_pages}")

