"""Production scheduling on a tiny random Gemma 3: budgets, fairness, preemption, aborts in every state."""

import random

import pytest

from gemmaserve import LLM, SamplingParams
from gemmaserve.engine.request import RequestStatus

from helpers import fresh_seed, save_checkpoint, tiny_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(tiny_hf_model(fresh_seed(), sliding_window=8), tmp_path_factory.mktemp("tiny"))


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 6))) for _ in range(n))


def _drain(eng, check=True):
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs.setdefault(o.request_id, {})[o.outputs[0].index] = o.outputs[0]
        if check:
            eng._kv.check_integrity()
    return outs


def test_long_prompt_does_not_starve_decodes(tiny_dir):
    llm = LLM(model=str(tiny_dir), max_num_batched_tokens=32, page_size=4)
    eng = llm.engine
    a = eng.add_request(_words(1, 5), SamplingParams(max_tokens=40, ignore_eos=True))
    while not eng._request(a).output_token_ids:
        eng.step()
    b = eng.add_request(_words(2, 200), SamplingParams(max_tokens=2, ignore_eos=True))  # ~800 tokens: many chunks
    for _ in range(10):
        before = len(eng._request(a).output_token_ids)
        eng.step()
        assert len(eng._request(a).output_token_ids) == before + 1      # a decodes every step
        assert eng._request(b).num_computed_tokens > 0                  # b's chunks progress too
    _drain(eng)


def test_short_budget_serves_every_decode_in_turn(tiny_dir):
    """A budget smaller than the number of decodes: prompts still get admitted, and decodes share
    the budget round robin."""
    llm = LLM(model=str(tiny_dir), max_num_batched_tokens=3, max_num_seqs=8, page_size=4)
    eng = llm.engine
    ids = [eng.add_request(_words(10 + i, 1), SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(6)]
    for _ in range(60):
        if all(eng._request(r).output_token_ids for r in ids):
            break
        eng.step()
    assert all(eng._request(r).output_token_ids for r in ids), "a prompt was starved by decodes"
    before = [len(eng._request(r).output_token_ids) for r in ids]
    for _ in range(30):
        eng.step()
    gained = [len(eng._request(r).output_token_ids) - b for r, b in zip(ids, before)]
    assert min(gained) >= 10 and max(gained) - min(gained) <= 1, gained
    _drain(eng)


def test_preempted_requests_resume_before_new_ones(tiny_dir):
    roomy = LLM(model=str(tiny_dir), page_size=4)
    kv = roomy.engine._kv
    budget = int(1.6 * kv.peak_pages(150, 16)) * kv.page_bytes
    llm = LLM(model=str(tiny_dir), page_size=4, kv_cache_memory=budget, enable_prefix_caching=False,
              max_num_batched_tokens=16)
    eng = llm.engine
    first = [eng.add_request(_words(20 + i, 12), SamplingParams(max_tokens=100, ignore_eos=True)) for i in range(4)]
    preempted = None
    for _ in range(400):
        eng.step()
        if eng._scheduler.num_preemptions:
            preempted = eng._scheduler.waiting[0]
            break
    assert preempted is not None and preempted.status is RequestStatus.WAITING
    late = eng.add_request(_words(99, 3), SamplingParams(max_tokens=5, ignore_eos=True))
    while preempted.status is RequestStatus.WAITING:
        assert eng._request(late).status is RequestStatus.WAITING   # the newcomer does not overtake
        eng.step()
    outs = _drain(eng)
    assert set(outs) == set(first) | {late}


@pytest.mark.parametrize("state", ["queued", "prefilling", "decoding", "preempted", "half_of_n"])
def test_abort_in_every_state_frees_everything(tiny_dir, state):
    roomy = LLM(model=str(tiny_dir), page_size=4)
    kv = roomy.engine._kv
    opts = dict(model=str(tiny_dir), page_size=4, max_num_batched_tokens=16)
    if state == "preempted":   # decodes outgrow the pool; the latest admitted is preempted
        opts["kv_cache_memory"] = kv.peak_pages(440, 16) * kv.page_bytes
    llm = LLM(**opts)
    eng = llm.engine
    params = SamplingParams(max_tokens=120, ignore_eos=True, n=3 if state == "half_of_n" else 1)
    others = [eng.add_request(_words(30 + i, 10), SamplingParams(max_tokens=100, ignore_eos=True)) for i in range(3)]
    target = eng.add_request(_words(40, 60), params)
    reqs = [r for r in eng._groups[target]]
    every = [r for g in (*others, target) for r in eng._groups[g]]
    cond = {
        "queued": lambda: True,
        "prefilling": lambda: 0 < reqs[0].num_computed_tokens < len(reqs[0].prompt_token_ids),
        "decoding": lambda: len(reqs[0].output_token_ids) > 2,
        "preempted": lambda: any(r.num_preemptions for r in eng._scheduler.waiting),
        "half_of_n": lambda: reqs[0].output_token_ids and reqs[1].status is RequestStatus.RUNNING,
    }[state]
    for _ in range(2000):
        if cond():
            break
        eng.step()
    assert cond(), state
    if state == "preempted":   # abort whichever request is waiting after a preemption
        victim = next(r for r in eng._scheduler.waiting if r.num_preemptions)
        assert victim.status is RequestStatus.WAITING
        others = [g for g in [*others, target] if g != victim.group_id]
        target, reqs = victim.group_id, eng._groups[victim.group_id]
    finals = eng.abort_request(target)
    assert finals and all(o.outputs[0].finish_reason == "abort" for o in finals)
    eng._kv.check_integrity()
    assert all(r.is_finished for r in reqs) and target not in eng._groups
    outs = _drain(eng)
    assert set(outs) == set(others)
    st = eng._kv.stats()
    assert st.pages_used == 0 and st.pages_free + st.pages_cached == st.num_pages
    assert eng.abort_request(target) == []      # aborting twice is harmless
    # The counters users read: each admitted request queried the prefix cache once (never again on
    # resuming after a preemption, nor for being aborted); only n > 1 siblings share a prompt.
    admitted = [r for r in every if r.admitted_order >= 0]
    assert st.prefix_query_tokens == sum(len(r.prompt_token_ids) - 1 for r in admitted)
    assert st.prefix_hit_tokens == sum(r.num_cached_tokens for r in admitted)
    assert (st.prefix_hit_tokens > 0) == (state == "half_of_n" and reqs[1].admitted_order >= 0)


def test_heavy_preemption_keeps_outputs_identical(tiny_dir):
    prompts = [_words(50 + i, 8 * (1 + i % 4)) for i in range(10)]
    params = [SamplingParams(max_tokens=90, ignore_eos=True, n=1 + i % 3, stop=["cc"] if i % 2 else None,
                             temperature=0.0 if i % 3 else 0.8, seed=i) for i in range(10)]
    ref = LLM(model=str(tiny_dir), page_size=4).generate(prompts, params)
    roomy = LLM(model=str(tiny_dir), page_size=4)
    kv = roomy.engine._kv
    tight = LLM(model=str(tiny_dir), page_size=4, max_num_batched_tokens=24,
                kv_cache_memory=int(1.2 * kv.peak_pages(230, 24)) * kv.page_bytes)
    got = tight.generate(prompts, params)
    assert tight.engine._scheduler.num_preemptions >= 5
    for r, g in zip(ref, got):
        assert [(c.text, c.token_ids, c.finish_reason) for c in r.outputs] == \
               [(c.text, c.token_ids, c.finish_reason) for c in g.outputs]
    tight.engine._kv.check_integrity()


def test_recomputation_after_preemption_is_no_cache_hit(tiny_dir):
    """Four unrelated prompts under a budget their decodes outgrow: requests are preempted and, on
    resuming, find their own recomputed blocks in the prefix cache. Those are no hits: usage's cached
    tokens and the hit rate stay 0 (they read 224 tokens and 46.5% before)."""
    roomy = LLM(model=str(tiny_dir), page_size=4)
    kv = roomy.engine._kv
    llm = LLM(model=str(tiny_dir), page_size=4, max_num_batched_tokens=16,
              kv_cache_memory=kv.peak_pages(120, 16) * kv.page_bytes)
    prompts = [_words(200 + i, 8) for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=100, ignore_eos=True))
    assert llm.engine._scheduler.num_preemptions > 0
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0]
    st = llm.engine._kv.stats()
    assert st.prefix_hit_tokens == 0 and st.prefix_hit_rate == 0.0
    assert st.prefix_query_tokens == sum(len(o.prompt_token_ids) - 1 for o in outs)
    # A genuine hit still counts: the same prompt again, with room to keep its blocks cached.
    roomy.generate([prompts[0]], SamplingParams(max_tokens=1))
    again = roomy.generate([prompts[0]], SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens > 0 and roomy.engine._kv.stats().prefix_hit_tokens == again.num_cached_tokens
