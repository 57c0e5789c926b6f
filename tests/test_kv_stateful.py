"""Hypothesis drives the V2 manager with random add / prefill chunk / decode / finish / abort /
preempt / prefix-hit sequences under a tiny budget, and checks after every step:

* check_integrity() (every page free, owned or cached exactly once; refcounts; windows);
* memory bounds (a decoding sequence holds at most ceil(W/T)+1 blocks per sliding layer);
* content: a shadow store records what each layer wrote where; every key a query reads through the
  page tables must hold that layer's K/V of the right token prefix (catches scratch aliasing, stale
  pages and wrong prefix hits, not just bookkeeping).
"""

from __future__ import annotations

import hashlib

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gemmaserve.kv.manager_v2 import KVCacheManagerV2
from gemmaserve.kv.spec import AttentionKind, LayerSpec

F32 = torch.float32
# Mixed shapes: sliding layers of 2 KV heads x 8 and a full layer of 1 x 8 (twice the tokens per
# page), two windows, and a tail layer that reads the last sliding layer's KV (Gemma 4 style).
SPEC_SETS = {
    "gemma3_like": [LayerSpec(AttentionKind.SLIDING, 1, 8, F32, window=6)] * 3
                   + [LayerSpec(AttentionKind.FULL, 1, 8, F32)]
                   + [LayerSpec(AttentionKind.SLIDING, 1, 8, F32, window=6)],
    "gemma4_like": [LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=5),
                    LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=5),
                    LayerSpec(AttentionKind.FULL, 1, 8, F32),
                    LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=9),
                    LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=5, kv_source=1),
                    LayerSpec(AttentionKind.FULL, 1, 8, F32, kv_source=2)],
}
BASES = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


def _prefix_id(tokens: list[int], k: int) -> bytes:
    return hashlib.blake2b(repr(tokens[:k + 1]).encode(), digest_size=8).digest()


class KVMachine(RuleBasedStateMachine):
    @initialize(spec_set=st.sampled_from(sorted(SPEC_SETS)), scratch=st.booleans(),
                pages=st.integers(min_value=40, max_value=120))
    def setup(self, spec_set, scratch, pages):
        self.specs = SPEC_SETS[spec_set]
        self.kv = KVCacheManagerV2(self.specs, 2, pages, enable_prefix_caching=True, enable_scratch=scratch)
        self.seqs: dict[str, dict] = {}   # id -> {"tokens", "prompt_len", "done"}
        self.waiting: list[list[int]] = []
        self.store: dict[tuple[int, int], tuple[int, bytes]] = {}   # (page, offset) -> (layer, prefix id)
        self.counter = 0

    # -- helpers --------------------------------------------------------------------------------
    def _page(self, sid: str, layer: int, pos: int) -> tuple[int, int]:
        g_idx, col = self.kv.layer_slot[layer]
        t = self.kv.groups[g_idx].tokens_per_page
        first, rows = self.kv.block_table(sid, g_idx)
        row = rows[pos // t - first]
        page = row if self.kv.layout.identity_slots else self.kv.slot_rows(g_idx, [row])[1][0][col]
        return page, pos % t

    def _forward(self, sid: str, start: int, end: int) -> None:
        """What the model does between allocate and commit: each layer in order writes its new K/V,
        then reads every key its queries can see."""
        tokens = self.seqs[sid]["tokens"]
        for layer, spec in enumerate(self.specs):
            src = layer if spec.owns_kv else spec.kv_source
            if spec.owns_kv:
                for p in range(start, end):
                    self.store[self._page(sid, layer, p)] = (layer, _prefix_id(tokens, p))
            for q in range(start, end):
                lo = 0 if spec.window is None else max(0, q - spec.window + 1)
                for k in range(lo, q + 1):
                    got = self.store.get(self._page(sid, layer, k))
                    assert got == (src, _prefix_id(tokens, k)), f"layer {layer} reads wrong KV at {k} for q={q}"

    def _step(self, sid: str, n: int) -> bool:
        s = self.seqs[sid]
        start = self.kv._seqs[sid].num_computed
        end = min(start + n, len(s["tokens"]))
        if not self.kv.allocate(sid, s["tokens"], start, end, prefill=end - start > 1):
            return False
        self._forward(sid, start, end)
        self.kv.commit(sid, s["tokens"], end)
        return True

    def _admit(self, tokens: list[int], n: int) -> None:
        sid = f"s{self.counter}"
        self.counter += 1
        hit = self.kv.lookup(sid, tokens)
        assert hit < len(tokens) and hit % 2 == 0
        end = min(len(tokens), hit + n)
        if self.kv.allocate(sid, tokens, hit, end, prefill=True):
            self.seqs[sid] = {"tokens": list(tokens), "prompt_len": len(tokens)}
            self._forward(sid, hit, end)
            self.kv.commit(sid, tokens, end)
        else:
            self.waiting.append(list(tokens))

    # -- rules ----------------------------------------------------------------------------------
    @rule(base=st.sampled_from(BASES), cut=st.integers(2, 14), tail=st.lists(st.integers(40, 60), max_size=12),
          n=st.integers(1, 12))
    def add(self, base, cut, tail, n):
        self._admit(base[:cut] + tail, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(2, 12))
    def prefill_chunk(self, data, n):
        pending = [s for s, v in self.seqs.items() if self.kv._seqs[s].num_computed < len(v["tokens"])]
        if pending:
            self._step(data.draw(st.sampled_from(sorted(pending))), n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(5, 60))
    def decode(self, data, token):
        ready = [s for s, v in self.seqs.items() if self.kv._seqs[s].num_computed == len(v["tokens"])]
        if ready:
            sid = data.draw(st.sampled_from(sorted(ready)))
            self.seqs[sid]["tokens"].append(token)
            if not self._step(sid, 1):
                self.seqs[sid]["tokens"].pop()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), how=st.sampled_from(["finish", "abort", "preempt"]))
    def end(self, data, how):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(sid)
        s = self.seqs.pop(sid)
        if how == "preempt":   # keeps its tokens, recomputed later (mostly from the prefix cache)
            self.waiting.append(s["tokens"])

    @precondition(lambda self: self.waiting)
    @rule(n=st.integers(1, 30))
    def resume(self, n):
        self._admit(self.waiting.pop(0), n)

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_integrity()
        st_ = self.kv.stats()
        assert st_.pages_free + st_.pages_used + st_.pages_cached == st_.num_pages
        assert st_.scratch_pages == 0
        for sid, s in self.seqs.items():
            if self.kv._seqs[sid].num_computed < s["prompt_len"]:
                continue
            for g, (first, n) in zip(self.kv.groups, self.kv.held_blocks(sid)):
                if g.sliding:
                    assert n <= -(-g.window // g.tokens_per_page) + 1


TestKVStateful = KVMachine.TestCase
TestKVStateful.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
