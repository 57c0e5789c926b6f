"""KV manager V2 on synthetic specs with the shapes of Gemma 3 1B/4B/27B and Gemma 4 E2B/31B."""

import math
import random

import pytest
import torch

from gemmaserve.kv import create_kv_manager
from gemmaserve.kv.groups import derive_groups
from gemmaserve.kv.manager_v2 import KVCacheManagerV2
from gemmaserve.kv.spec import AttentionKind
from gemmaserve.testing.shapes import SHAPES


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 50_000) for _ in range(n)]


def _prefill(kv, sid, tokens, chunk, start=0, on_step=None):
    """Drive one sequence through chunked prefill (allocate, 'forward', commit)."""
    pos = start
    while pos < len(tokens):
        end = min(pos + chunk, len(tokens))
        assert kv.allocate(sid, tokens, pos, end, prefill=True)
        if on_step:
            on_step()
        kv.commit(sid, tokens, end)
        kv.check_integrity()
        pos = end


def _decode(kv, sid, tokens, steps, on_step=None):
    for _ in range(steps):
        tokens.append(len(tokens) % 997 + 5)
        n = len(tokens)
        assert kv.allocate(sid, tokens, n - 1, n, prefill=False)
        if on_step:
            on_step()
        kv.commit(sid, tokens, n)
        kv.check_integrity()


def test_groups_follow_specs_not_names():
    g3 = derive_groups(SHAPES["gemma3-27b"].layer_specs(), 16)
    kinds = [(g.kind, g.window, g.num_layers, g.tokens_per_page) for g in g3.groups]
    assert kinds == [(AttentionKind.SLIDING, 1024, 52, 16), (AttentionKind.FULL, None, 10, 16)]
    assert g3.page_bytes == 16 * 2 * 16 * 128 * 2

    # Gemma 4 31B: global layers have 4 KV heads x 512 = half the bytes per token of sliding 16 x 256,
    # so a page of the same size holds twice the tokens: no padding, no waste.
    g31 = derive_groups(SHAPES["gemma4-31b"].layer_specs(), 16)
    (sl, fu) = g31.groups
    assert (sl.num_layers, sl.tokens_per_page, fu.num_layers, fu.tokens_per_page) == (50, 16, 10, 32)
    assert g31.page_bytes == 16 * 2 * 16 * 256 * 2 == 32 * 2 * 4 * 512 * 2

    # Gemma 4 E2B: layers 15..34 own no KV and read the last non-shared layer of their kind.
    specs = SHAPES["gemma4-e2b"].layer_specs()
    e2b = derive_groups(specs, 16)
    sl, fu = e2b.groups
    assert sl.num_layers + fu.num_layers == 15 and max(sl.layers + fu.layers) == 14
    for i in range(15, 35):
        src = specs[i].kv_source
        assert e2b.layer_slot[i] == e2b.layer_slot[src] and src in (13, 14)
    assert sl.tokens_per_page == 2 * fu.tokens_per_page  # 1 x 256 vs 1 x 512 per token


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("scratch", [False, True])
def test_memory_bounds_during_prefill_and_decode(shape, scratch):
    specs = SHAPES[shape].layer_specs()
    kv = KVCacheManagerV2(specs, 16, 400_000, enable_prefix_caching=True, enable_scratch=scratch)
    window = SHAPES[shape].window
    prompt = _tokens(3 * window + 37)
    chunk = window + 100
    peaks = []

    def held():
        first_blocks = kv.held_blocks("s")
        return [n for (_, n) in first_blocks]

    def check_prefill():
        st = kv.stats()
        peaks.append(st)

    _prefill(kv, "s", prompt, chunk, on_step=check_prefill)
    tokens = list(prompt)

    def check_decode():
        for g, n in zip(kv.groups, held()):
            if g.sliding:
                assert n <= math.ceil(g.window / g.tokens_per_page) + 1, (g, n)
            else:
                assert n == g.num_blocks(len(tokens))

    _decode(kv, "s", tokens, 3 * 16 + 5, on_step=check_decode)
    for g, st in zip(kv.groups, peaks[-1].groups):
        if not g.sliding:
            continue
        t = g.tokens_per_page
        window_pages = g.num_layers * (math.ceil((g.window - 1) / t) + 1)
        chunk_pages = g.num_blocks(chunk) + 1
        if scratch:
            # Each layer holds the window the chunk's first queries read (from the previous step) and
            # the window at the chunk's end; the rest of the chunk is one layer's worth of scratch.
            assert max(p.groups[g.index].pages_used for p in peaks) <= 2 * (window_pages + g.num_layers) + chunk_pages
            first = peaks[0].groups[g.index]
            assert first.pages_used <= window_pages + g.num_layers + chunk_pages
        else:        # every layer holds window + chunk
            assert max(p.groups[g.index].pages_used for p in peaks) <= g.num_layers * (
                math.ceil((g.window - 1 + chunk) / t) + 1)
    assert kv.stats().scratch_pages == 0  # never between steps


def test_scratch_peak_is_one_layer_of_the_chunk():
    """Chunk of 8K on the 27B shape: without scratch a sliding layer holds window + chunk pages; with
    scratch the group holds every layer's window plus one layer's worth of the chunk."""
    specs = SHAPES["gemma3-27b"].layer_specs()
    peak = {}
    for scratch in (False, True):
        kv = KVCacheManagerV2(specs, 16, 2_000_000, enable_prefix_caching=False, enable_scratch=scratch)
        seen: list = []
        _prefill(kv, "s", _tokens(16384), 8192, on_step=lambda: seen.append(kv.stats().groups[0]))
        peak[scratch] = max(s.pages_used for s in seen)
        first_chunk_peak = seen[0].pages_used
        # Blocks wholly before the window of position 8176 (the last block edge before the chunk end).
        assert max(s.scratch_pages for s in seen) == ((8176 - 1024 + 1) // 16 if scratch else 0)
    layers, t = 52, 16
    assert layers * 8192 // t <= peak[False] <= layers * ((8192 + 1024) // t + 1)
    # First chunk: every layer's window (+ the block edge kept for prefix hits) + one layer of the chunk.
    assert first_chunk_peak <= layers * (1024 // t + 2) + 8192 // t
    # Later chunks also hold the previous window, which the chunk's first queries read.
    assert peak[True] <= layers * 2 * (1024 // t + 2) + 8192 // t
    assert peak[True] < peak[False] / 4


def test_prefix_hits_full_and_sliding_tail():
    specs = SHAPES["gemma3-1b"].layer_specs()
    kv = KVCacheManagerV2(specs, 16, 100_000, enable_prefix_caching=True, enable_scratch=True)
    prompt = _tokens(2000, seed=1)
    _prefill(kv, "a", prompt, 1024)   # chunks of 2 windows: most sliding blocks go to scratch
    assert kv.stats().scratch_pages == 0
    kv.free("a")
    # Same prompt: everything but the last token (rounded down to a block) is reused.
    assert kv.lookup("b", prompt) == (len(prompt) - 1) // 16 * 16
    # Extended prompt: the hit stops where the first prompt's window tail is present (its end).
    longer = prompt + _tokens(300, seed=2)
    assert kv.lookup("c", longer) == 2000
    # A prompt that diverges in the middle of a scratch region: full layers could reuse more, but
    # sliding layers need real pages for the window, which only chunk ends kept.
    branch = prompt[:1100] + _tokens(500, seed=3)
    assert kv.lookup("d", branch) == 1024   # the window kept at the first chunk end
    # Without scratch every full block of the sliding group is cached too: the hit reaches the branch point.
    kv2 = KVCacheManagerV2(specs, 16, 100_000, enable_prefix_caching=True, enable_scratch=False)
    _prefill(kv2, "a", prompt, 1024)
    kv2.free("a")
    assert kv2.lookup("d", branch) == 1100 // 16 * 16


def test_hit_allocation_shares_pages_and_counts_rate():
    specs = SHAPES["gemma4-31b"].layer_specs()
    kv = KVCacheManagerV2(specs, 16, 200_000, enable_prefix_caching=True)
    prompt = _tokens(3000, seed=4)
    _prefill(kv, "a", prompt, 1000)
    kv.record_prefix_query(len(prompt) - 1, 0)   # as the scheduler does at each first admission
    hit = kv.lookup("b", prompt)
    assert hit == (len(prompt) - 1) // 32 * 32   # the lcm of both groups' tokens per page (16, 32)
    kv.record_prefix_query(len(prompt) - 1, hit)
    used_before = kv.stats().pages_used
    assert kv.allocate("b", prompt, hit, len(prompt), prefill=True)
    kv.commit("b", prompt, len(prompt))
    kv.check_integrity()
    # "b" shares a's pages; it only added the blocks after the hit point.
    assert kv.stats().pages_used - used_before <= sum(g.num_layers * 2 for g in kv.groups)
    st = kv.stats()
    assert st.prefix_hit_tokens == hit and st.prefix_query_tokens == 2 * (len(prompt) - 1)
    assert 0.45 < st.prefix_hit_rate < 0.5


def test_lru_eviction_under_pressure():
    """Finished sequences stay cached until a new allocation needs their pages; the least recently
    used go first (and a sequence's tail before its head)."""
    specs = SHAPES["gemma3-1b"].layer_specs()
    kv = create_kv_manager("v2", specs, 16, 20_000 * derive_groups(specs, 16).page_bytes, enable_prefix_caching=True)
    prompts = [_tokens(1200, seed=10 + i) for i in range(6)]   # ~1950 pages each once cached
    for i, p in enumerate(prompts):
        _prefill(kv, f"s{i}", p, 512)
        kv.free(f"s{i}")
    st = kv.stats()
    assert st.pages_cached > 6 * 1900 and st.pages_used == 0
    assert all(kv.lookup("probe", p) > 0 for p in prompts)
    _prefill(kv, "big", _tokens(8000, seed=99), 512)   # needs more than the free pages: evicts
    assert kv.stats().pages_free < 26   # the pool ran dry: eviction happened
    assert kv.lookup("again0", prompts[0]) == 0           # least recently used: evicted
    assert kv.lookup("again5", prompts[5]) == (1200 - 1) // 16 * 16   # most recent: intact
    kv.check_integrity()


def test_allocation_is_atomic_when_out_of_pages():
    specs = SHAPES["gemma3-1b"].layer_specs()
    kv = KVCacheManagerV2(specs, 16, 500, enable_prefix_caching=False)
    before = kv.stats()
    assert not kv.allocate("x", _tokens(4000), 0, 4000, prefill=True)
    assert kv.stats() == before
    kv.check_integrity()


def test_integrity_check_catches_corruption():
    specs = SHAPES["gemma3-1b"].layer_specs()
    kv = KVCacheManagerV2(specs, 16, 10_000, enable_prefix_caching=True)
    _prefill(kv, "a", _tokens(700), 700)
    kv.check_integrity()
    seq = kv._seqs["a"]
    # A sliding table that still holds a block out of every window.
    seq.tables[0].first -= 1
    seq.tables[0].slots.insert(0, seq.tables[1].slots[0])
    with pytest.raises(AssertionError):
        kv.check_integrity()
    seq.tables[0].slots.pop(0)
    seq.tables[0].first += 1
    kv.check_integrity()
    # A cached block registered under another block's key (content and key disagree).
    full = seq.tables[1]
    full.slots[0].key, full.slots[1].key = full.slots[1].key, full.slots[0].key
    with pytest.raises(AssertionError, match="another's key"):
        kv.check_integrity()
    full.slots[0].key, full.slots[1].key = full.slots[1].key, full.slots[0].key
    kv.check_integrity()
    # A table that lost its last block (the next query would read a page nobody holds).
    tail = full.slots.pop()
    full.rows.pop()
    with pytest.raises(AssertionError, match="misses its tail"):
        kv.check_integrity()
    full.append(tail)
    kv.check_integrity()
    # A page both in a slot and on the free list.
    kv.pool._free.append(seq.tables[1].slots[0].pages[0])
    with pytest.raises(AssertionError, match="free"):
        kv.check_integrity()


def test_commit_before_allocate_and_bad_start_are_rejected():
    kv = KVCacheManagerV2(SHAPES["gemma3-1b"].layer_specs(), 16, 10_000)
    toks = _tokens(100)
    with pytest.raises(ValueError, match="not cached"):
        kv.allocate("a", toks, 48, 100, prefill=True)
    assert kv.allocate("a", toks, 0, 50, prefill=True)
    with pytest.raises(ValueError, match="computed"):
        kv.allocate("a", toks, 60, 100, prefill=True)


def test_bf16_and_fp32_layers_use_bytes_not_counts():
    specs = SHAPES["gemma3-4b"].layer_specs(torch.float32)
    geo = derive_groups(specs, 16)
    assert geo.page_bytes == 16 * 2 * 4 * 256 * 4


def test_block_hashes_live_with_the_sequence_and_are_never_recomputed(monkeypatch):
    """A request's hash chain is hashed once: looking it up again (a blocked head of the queue, every
    step), admitting it, committing and resuming it after a preemption only hash new blocks."""
    import gemmaserve.kv.block_hash as bh

    specs = SHAPES["gemma3-1b"].layer_specs()
    kv = KVCacheManagerV2(specs, 16, 100_000, enable_prefix_caching=True, enable_scratch=True)
    calls = []
    digest = bh._digest
    monkeypatch.setattr(bh, "_digest", lambda data: calls.append(1) or digest(data))
    prompt, chain = _tokens(1008, seed=5), []
    kv.lookup("a", prompt, chain)
    first = len(calls)
    assert first == len(chain) == (1008 - 1) // 16
    for _ in range(3):
        assert kv.lookup("a", prompt, chain) == 0 and len(calls) == first   # nothing cached yet, nothing rehashed
    assert kv.allocate("a", prompt, 0, 1008, prefill=True, chain=chain)
    kv.commit("a", prompt, 1008)
    assert len(calls) == first + 1 and len(chain) == 1008 // 16            # one block more: the last one
    kv.free("a")                                                          # preempted: chain stays with it
    hit = kv.lookup("a", prompt, chain)
    assert hit == (1008 - 1) // 16 * 16 and len(calls) == first + 1
    # The chain is the one a fresh computation gives.
    fresh: list[bytes] = []
    bh.extend_chain(fresh, prompt, 16, kv._root)
    assert fresh == chain
