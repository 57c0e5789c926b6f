"""V1 paged KV bookkeeping, and the scheduler under memory pressure (preemption, aborts)."""

import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.kv.manager_v1 import KVCacheManagerV1
from gemmaserve.kv.page_pool import PagePool
from gemmaserve.kv.spec import AttentionKind, LayerSpec

from helpers import fresh_seed, save_checkpoint, tiny_hf_model

SPECS = [LayerSpec(AttentionKind.SLIDING, 1, 16, torch.float32, window=4)] * 3 + \
        [LayerSpec(AttentionKind.FULL, 1, 16, torch.float32)]


def test_page_pool_is_all_or_nothing():
    pool = PagePool(4)
    assert pool.allocate(5) is None and pool.num_free == 4
    pages = pool.allocate(3)
    assert len(set(pages)) == 3 and pool.num_free == 1
    pool.free(pages[:1])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(pages[:1])


def _table(kv, seq):
    return kv.block_table(seq, 0)[1]


def test_v1_allocate_grows_tables_atomically():
    kv = KVCacheManagerV1(SPECS, page_size=4, num_pages=5)
    toks = list(range(12))
    assert kv.page_bytes == 4 * 4 * 2 * 16 * 4
    assert kv.allocate("a", toks, 0, 9, True) and len(_table(kv, "a")) == 3
    assert kv.allocate("a", toks, 9, 12, True) and len(_table(kv, "a")) == 3
    assert not kv.allocate("b", toks, 0, 12, True)          # needs 3, only 2 free: nothing taken
    assert kv.num_free_pages == 2 and "b" not in kv._tables
    assert kv.allocate("b", toks, 0, 8, True)
    kv.check_integrity()
    kv.free("a")
    assert kv.num_free_pages == 3
    kv.check_integrity()


def test_v1_integrity_check_catches_corruption():
    kv = KVCacheManagerV1(SPECS, page_size=4, num_pages=6)
    kv.allocate("a", list(range(8)), 0, 8, True)
    kv.allocate("b", list(range(4)), 0, 4, True)
    kv._tables["b"].append(kv._tables["a"][0])  # a page owned twice
    with pytest.raises(AssertionError, match="owned by both"):
        kv.check_integrity()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(tiny_hf_model(fresh_seed(), sliding_window=8), tmp_path_factory.mktemp("tiny"))


def _prompts() -> list[str]:
    """Six prompts of different lengths that share no prefix (so the prefix cache cannot save memory)."""
    import random

    rng = random.Random(7)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(9 * k)) for k in (1, 3, 2, 4, 1, 2)]


PROMPTS = _prompts()


def _run(llm: LLM, params: SamplingParams, check_each_step: bool = True):
    eng = llm.engine
    ids = [eng.add_request(p, params) for p in PROMPTS]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out.outputs[0].token_ids
        if check_each_step:
            eng._kv.check_integrity()
    return [done[i] for i in ids]


@pytest.mark.parametrize("manager, scratch", [("v1", "off"), ("v2", "off"), ("v2", "on")])
def test_preemption_under_small_budget_gives_identical_greedy_output(tiny_dir, manager, scratch):
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    opts = dict(page_size=4, kv_cache_manager=manager, swa_scratch_reuse=scratch, max_num_batched_tokens=64)
    roomy = LLM(model=str(tiny_dir), **opts)
    ref = _run(roomy, params)
    # Room for the longest request at its peak, but far less than all six together. Admission keeps
    # room for admitted prompts, so it is the long decodes growing together that preempt.
    kv = roomy.engine._kv
    longest = max(len(roomy.tokenizer.encode(p)) for p in PROMPTS) + params.max_tokens
    budget = int(2.0 * kv.peak_pages(longest, 64)) * kv.page_bytes
    tight = LLM(model=str(tiny_dir), kv_cache_memory=budget, **opts)
    got = _run(tight, params)
    assert tight.engine._scheduler.num_preemptions > 0
    assert got == ref
    stats = tight.engine._kv.stats()
    assert stats.pages_used == 0 and stats.pages_free + stats.pages_cached == stats.num_pages


def test_abort_frees_pages_at_any_point(tiny_dir):
    llm = LLM(model=str(tiny_dir), page_size=4, max_num_batched_tokens=16)
    eng = llm.engine
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    a = eng.add_request(PROMPTS[3], params)   # long: still prefilling after one step
    b = eng.add_request(PROMPTS[0], params)
    eng.step()
    assert eng._kv.num_free_pages < eng._kv.num_pages
    eng.abort_request(a)
    eng._kv.check_integrity()
    c = eng.add_request(PROMPTS[1], params)   # queued, then aborted before running
    eng.abort_request(c)
    while eng.has_unfinished_requests():
        eng.step()
        eng._kv.check_integrity()
    assert eng._kv.num_free_pages == eng._kv.num_pages
    with pytest.raises(KeyError):
        eng._request(b)


def test_max_model_len_stops_generation(tiny_dir):
    llm = LLM(model=str(tiny_dir), max_model_len=24)
    out = llm.generate(["abc"], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 24
