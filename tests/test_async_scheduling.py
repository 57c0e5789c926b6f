"""Asynchronous scheduling (step N+1 scheduled and launched before step N's ids are read back; the
next step's input ids come from the device) gives exactly what the synchronous engine gives: tokens,
text, logprobs, finish reasons, cached-token counts, for every cache mode, with sampling, penalties,
stop strings, n > 1, preemption and aborts."""

from __future__ import annotations

import dataclasses
import random

import pytest

from gemmaserve import LLM, SamplingParams

from helpers import fresh_seed, save_checkpoint, tiny_gemma4_hf, tiny_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(tiny_hf_model(fresh_seed(), sliding_window=8), tmp_path_factory.mktemp("tiny"))


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 6))) for _ in range(n))


def _workload(seed: int):
    rng = random.Random(seed)
    shared = _words(rng, 12)
    prompts, params = [], []
    for i in range(7):
        prompts.append((shared + " " if i % 3 == 0 else "") + _words(rng, rng.randint(3, 30)))
        params.append(SamplingParams(
            max_tokens=rng.choice([1, 40]) if i == 4 else rng.randint(16, 40), ignore_eos=i % 4 != 0, n=1 + (i % 5 == 1),
            temperature=0.0 if i % 2 else 0.9, top_p=0.9 if i % 3 == 1 else 1.0, top_k=5 if i == 3 else 0,
            seed=100 + i, stop=["cc"] if i % 4 == 2 else None, logprobs=2 if i % 3 == 2 else None,
            repetition_penalty=1.3 if i == 5 else 1.0, frequency_penalty=0.5 if i == 7 else 0.0))
    return prompts, params


def _assert_same(got, ref, cached: bool = True) -> None:
    """Everything a user reads; logprobs within 1e-4 (a different batch composition reorders float sums)."""
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert not cached or g.num_cached_tokens == r.num_cached_tokens
        for a, b in zip(g.outputs, r.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
                   (b.token_ids, b.text, b.finish_reason, b.stop_reason)
            assert (a.logprobs is None) == (b.logprobs is None)
            for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
                assert [t for t, _ in x.top] == [t for t, _ in y.top] or \
                    max(abs(u - v) for (_, u), (_, v) in zip(x.top, y.top)) < 1e-4   # a near-tie may swap


@pytest.mark.parametrize("cache,preempts", [
    (dict(kv_cache_manager="v2", swa_scratch_reuse="on"), True),
    # Windows bound what a decoding sequence holds: at this budget it may or may not preempt.
    (dict(kv_cache_manager="v2", swa_scratch_reuse="off", enable_prefix_caching=False), None),
    (dict(kv_cache_manager="v1"), True),
])
def test_async_equals_sync(tiny_dir, cache, preempts):
    prompts, params = _workload(7)
    common = dict(model=str(tiny_dir), page_size=4, max_num_batched_tokens=32, **cache)
    sync = LLM(**common, async_scheduling="off")
    ref = sync.generate(prompts, params)
    eng = LLM(**common, async_scheduling="on")
    assert eng.engine._async_scheduling and not sync.engine._async_scheduling
    _assert_same(eng.generate(prompts, params), ref)
    # A budget that preempts: every request decodes long, the largest fits with 30% to spare. In-flight samples
    # survive preemption.
    params = [dataclasses.replace(p, max_tokens=64, ignore_eos=True, stop=None) for p in params]
    ref = sync.generate(prompts, params)
    kv = sync.engine._kv
    longest = max(len(sync.engine.inputs.tokenize(p)) + sp.max_tokens for p, sp in zip(prompts, params))
    tight = LLM(**common, async_scheduling="on", kv_cache_memory=int(1.3 * kv.peak_pages(longest, 32) + 2) * kv.page_bytes)
    _assert_same(tight.generate(prompts, params), ref, cached=False)
    if preempts is not None:   # lengths are fixed (ignore_eos): so is the schedule
        assert (tight.engine._scheduler.num_preemptions > 0) == preempts
    for e in (eng.engine, tight.engine):
        assert not e.has_unfinished_requests() and e.snapshot().pages_used == 0
        e.check_integrity()


def test_async_gemma4_and_aborts(tmp_path):
    path = save_checkpoint(tiny_gemma4_hf(fresh_seed(), "e2b"), tmp_path / "e2b")
    prompts, params = _workload(11)
    ref = LLM(model=str(path), page_size=4, async_scheduling="off").generate(prompts, params)
    llm = LLM(model=str(path), page_size=4, async_scheduling="on")
    _assert_same(llm.generate(prompts, params), ref)
    # Abort a request while a step of it is in flight: it finishes "abort", frees its pages, and the
    # in-flight result is dropped.
    eng = llm.engine
    rid = eng.add_request(prompts[0], SamplingParams(max_tokens=50, ignore_eos=True))
    keep = eng.add_request(prompts[1], SamplingParams(max_tokens=6, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng._inflight is not None
    (out,) = eng.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            final[o.request_id] = o
    assert rid not in final and final[keep].finished
    assert final[keep].outputs[0].token_ids == LLM(model=str(path), page_size=4, async_scheduling="off").generate(
        [prompts[1]], SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    assert eng._kv.num_used_pages == 0
    eng._kv.check_integrity()
