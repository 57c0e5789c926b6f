"""Speculative decoding with a draft model (`--speculative-config '{"method": "draft_model", "model": ...}'`):
a smaller Gemma drafts inside the step, its KV layers in the target's pool; the output equals one token
per step in every cache mode, and a draft that is the target itself is always accepted."""

from __future__ import annotations

import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.config.engine import EngineConfig
from gemmaserve.errors import UserInputError

from helpers import (check_aborts_mid_speculation, check_grammar_cut, check_warm_rerun, generate_rows, run_rows,
                     save_checkpoint, tiny_hf_model)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Gemma 3 target, itself as a draft, and a near copy of it (noisy weights, 2 layers fewer)
    that agrees with it often but not always."""
    root = tmp_path_factory.mktemp("draft")
    target = tiny_hf_model(21, sliding_window=6, num_key_value_heads=2)
    path = save_checkpoint(target, root / "target")
    near = tiny_hf_model(21, sliding_window=6, num_key_value_heads=2, num_hidden_layers=5)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        theirs = dict(target.named_parameters())
        for name, p in near.named_parameters():
            p.copy_(theirs[name] + 0.1 * p.std() * torch.randn(p.shape, generator=g))
    near.tie_weights()
    return str(path), str(save_checkpoint(near, root / "near")), LLM(model=str(path), page_size=4)


def _draft(model: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "disable_by_batch_size": 64}


PROMPTS = ["abcdefghij klmnop qrstuv " * 6, "zyxw vuts " * 5, "hello world " * 3, "one two three four five"]
MODES = {
    "v1": dict(kv_cache_manager="v1"),
    "v2+scratch+prefix": dict(kv_cache_manager="v2", swa_scratch_reuse="on", enable_prefix_caching=True),
    "chunk 8": dict(kv_cache_manager="v2", max_num_batched_tokens=8),
    "async": dict(async_scheduling="on"),
    "fp8 kv": dict(kv_cache_dtype="fp8"),
}


def _generate(path, base, opts, params, spec):
    return generate_rows(path, base, opts, params, spec, PROMPTS)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_tokens_equal_without_drafts_in_every_cache_mode(models, mode):
    path, near, base = models
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref, _ = _generate(path, base, MODES[mode], params, None)
    llm = LLM.from_config(EngineConfig(model=path, page_size=4, **MODES[mode], speculative_config=_draft(near)), base)
    assert run_rows(llm, PROMPTS, params) == ref
    st = llm.engine._scheduler.spec_stats
    assert 0 < st.accepted < st.drafted and st.accepted_at[2] > 0, st   # rejected, partly and wholly accepted
    if mode == "v2+scratch+prefix":   # warm: the draft model's KV comes back with the target's prefix hits
        check_warm_rerun(llm, PROMPTS, params, ref)


def test_the_target_as_its_own_draft_is_always_accepted(models):
    """Every draft is the target's own greedy token, so all are accepted: the draft model's KV (mirrored
    prefill, drafted positions, rolled-back ones) is exactly the target's."""
    path, _, base = models
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref, _ = _generate(path, base, dict(max_num_batched_tokens=16), params, None)
    got, engine = _generate(path, base, dict(max_num_batched_tokens=16), params, _draft(path, 4))
    st = engine._scheduler.spec_stats
    assert got == ref and st.drafted > 50 and st.accepted == st.drafted, st


def test_drafts_the_grammar_forbids_never_reach_the_forward(models):
    """Structured output: the target as its own draft guesses its unconstrained greedy tokens, which the
    grammar often forbids; those drafts and the ones after them are cut before the target's forward
    (the draft model drafted them already), the text is what it is without drafts."""
    path, _, base = models
    check_grammar_cut(path, base, _draft(path), PROMPTS[:3], 16)


def test_a_preempted_request_rebuilds_the_draft_models_kv(models):
    """Requests preempted mid-decode (their pages freed) come back through prefill, which recomputes the
    draft model's KV too: with the target as the draft, every draft is still accepted."""
    from gemmaserve.engine.scheduler import _Decision

    path, _, base = models
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, params)]
    engine = LLM.from_config(EngineConfig(model=path, page_size=4, speculative_config=_draft(path)), base).engine
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps in (3, 5):
            engine._scheduler._preempt(engine._scheduler.running[-1], _Decision())
    engine._kv.check_integrity()
    st = engine._scheduler.spec_stats
    assert [done[i] for i in ids] == want and st.accepted == st.drafted > 0, st
    assert engine._scheduler.num_preemptions == 2


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_requests_aborted_with_drafts_in_flight_leave_the_others_and_the_counters_whole(models, async_scheduling):
    """Requests aborted with drafts in flight (verified by the step just done, or in the step launched) and the
    draft model's KV in their pages, beside requests that go on, with and without asynchronous scheduling:
    check_aborts_mid_speculation."""
    path, near, base = models
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, params)]
    engine = LLM.from_config(EngineConfig(model=path, page_size=4, async_scheduling=async_scheduling,
                                          speculative_config=_draft(near)), base).engine
    check_aborts_mid_speculation(engine, PROMPTS, params, want)


def test_sampling_with_seeds_and_stops_equal_without_drafts(models):
    path, near, base = models
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=3, logprobs=2, stop=["vu"],
                            ignore_eos=True)
    ref, _ = _generate(path, base, {}, params, None)
    got, engine = _generate(path, base, {}, params, _draft(near, 4))
    assert got == ref and engine._scheduler.spec_stats.accepted > 0


def test_draft_models_that_cannot_draft_for_the_target_are_refused(models, tmp_path):
    path, _, base = models
    bigger = save_checkpoint(tiny_hf_model(3, vocab_size=320), tmp_path / "bigger")
    for model, match in [(str(bigger), "more than the target's"),
                         (str(tmp_path / "missing"), "^speculative config: draft model: model '.*missing' is neither a "
                                                     "known alias")]:
        with pytest.raises(UserInputError, match=match):
            LLM.from_config(EngineConfig(model=path, page_size=4, speculative_config=_draft(model)), base)
    with pytest.raises(UserInputError, match='needs "model"'):
        EngineConfig(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


@pytest.mark.slow
def test_270m_drafts_for_itself(llm_270m_q):
    """The embedded 270M as the draft model of the 270M (the real tokenizer and vocabulary checks, the
    real KV geometry twice in one pool): every draft accepted, the same tokens."""
    params = SamplingParams(max_tokens=24)
    prompts = ["The capital of France is", "List three colours: red,"]
    want = [o.outputs[0].token_ids for o in llm_270m_q.generate(prompts, params)]
    llm = LLM.from_config(llm_270m_q.engine.config.replace(speculative_config=_draft("gemma3-270m", 4)), llm_270m_q)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    st = llm.engine._scheduler.spec_stats
    assert st.drafted > 0 and st.accepted == st.drafted, st


def test_two_tensor_parallel_ranks_split_the_draft_model_like_the_target(models):
    """Each rank loads its shard of the draft model (heads, MLP and vocabulary split as the target's), its
    KV layers after the target's in that rank's pool: the same drafts accepted as in one process, and
    greedy tokens equal one process without drafts."""
    path, near, base = models
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want, _ = _generate(path, base, {}, params, None)
    _, single = _generate(path, base, {}, params, _draft(near))
    two = LLM(path, page_size=4, tensor_parallel_size=2, speculative_config=_draft(near))
    try:
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params)] == [row[0] for row in want]
        st, one = two.engine._scheduler.spec_stats, single.snapshot().spec
        assert 0 < st.accepted < st.drafted and abs(st.accepted - one.accepted) <= one.drafted // 20, (st, one)
    finally:
        two.engine.shutdown()
