"""Streaming (iterator and asyncio) and the full sampling surface, on the real Gemma 3 270M."""

import asyncio

import pytest
import torch

from gemmaserve import SamplingParams, UserInputError

PROMPTS = ["The capital of France is", "List three colours:\n1.", "日本の首都は", "def add(a, b):"]


def _collect(stream):
    texts, ids, finish = {}, {}, {}
    for out in stream:
        c = out.outputs[0]
        key = (out.prompt_index, c.index)
        texts[key] = texts.get(key, "") + c.delta_text
        ids[key] = ids.get(key, []) + c.delta_token_ids
        # Streamed outputs carry what is new; the final one also the whole text: the concatenated deltas.
        assert (c.text, c.token_ids) == ((texts[key], ids[key]) if c.finished else ("", []))
        if c.finished:
            finish[key] = c.finish_reason
    return texts, ids, finish


def test_stream_equals_generate(llm_270m_q):
    """Streamed deltas assemble to generate's text, ids and finish reason, with and without stop strings
    (the three stop lists in one batch: each prompt's tokens do not depend on its batch)."""
    stops = [[], ["."], ["\n2", "blue"]]
    prompts = [p for _ in stops for p in PROMPTS]
    params = [SamplingParams(max_tokens=20, stop=stop) for stop in stops for _ in PROMPTS]
    ref = llm_270m_q.generate(prompts, params)
    texts, ids, finish = _collect(llm_270m_q.stream(prompts, params))
    for i, out in enumerate(ref):
        c, stop = out.outputs[0], params[i].stop
        assert texts[(i, 0)] == c.text and ids[(i, 0)] == c.token_ids and finish[(i, 0)] == c.finish_reason
        for s in stop:
            assert s not in c.text
        if not stop:
            assert c.text == llm_270m_q.tokenizer.decode(c.token_ids)
    assert {o.outputs[0].finish_reason for o in ref} == {"stop", "length"}


def test_async_stream_equals_generate(llm_270m_q):
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=11)
    ref = llm_270m_q.generate(PROMPTS[:2], params)

    async def run():
        got = {}
        async for out in llm_270m_q.astream(PROMPTS[:2], params):
            got[out.prompt_index] = got.get(out.prompt_index, "") + out.outputs[0].delta_text
        return got

    got = asyncio.run(run())
    assert [got[i] for i in range(2)] == [o.outputs[0].text for o in ref]


def test_closing_a_stream_aborts_and_frees(llm_270m_q):
    eng = llm_270m_q.engine
    it = llm_270m_q.stream(["Tell me a long story about dragons."], SamplingParams(max_tokens=200))
    next(it)
    assert eng.has_unfinished_requests()
    it.close()
    assert not eng.has_unfinished_requests()
    eng._kv.check_integrity()
    assert eng._kv.stats().pages_used == 0


def test_stop_strings_and_stop_token_ids(llm_270m_q):
    free = llm_270m_q.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12))[0].outputs[0]
    assert free.finish_reason == "length" and " 6," in free.text
    cut = llm_270m_q.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12, stop=[" 6"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == " 6" and cut.text == free.text[:free.text.index(" 6")]
    tok_id = free.token_ids[2]
    by_id = llm_270m_q.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12, stop_token_ids=[tok_id]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tok_id and by_id.token_ids == free.token_ids[:3]


def test_logprobs_match_transformers(llm_270m, hf_270m):
    out = llm_270m.generate(["The capital of France is"], SamplingParams(max_tokens=5, logprobs=3))[0]
    c = out.outputs[0]
    ids = out.prompt_token_ids + c.token_ids
    with torch.no_grad():
        logits = hf_270m(torch.tensor([ids])).logits[0].float()
    # Media tokens are outside a text-only model's vocabulary (never sampled, no probability mass).
    logits[:, llm_270m.engine._suppressed_token_ids] = float("-inf")
    ref = torch.log_softmax(logits, -1)
    for k, lp in enumerate(c.logprobs):
        row = ref[len(out.prompt_token_ids) - 1 + k]
        assert lp.token_id == c.token_ids[k]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-3
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert lp.top[0][0] == lp.token_id   # greedy picks the most likely


def test_penalties_and_min_p_match_transformers_processors():
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper)

    from gemmaserve.engine.sampler import SamplingState, apply_penalties, filtered_probs

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 50, generator=gen) * 3
    prompt, output = [3, 4, 5, 5], [7, 7, 7, 9]
    cpu = torch.device("cpu")
    states = [SamplingState.create(SamplingParams(repetition_penalty=1.7), 0, prompt, cpu),
              SamplingState.create(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), 0, prompt, cpu)]
    for st in states:   # the runner counts each token it samples
        _, counts = st.penalty_tensors(50, cpu)
        counts.index_add_(0, torch.tensor(output), torch.ones(len(output)))
    got = apply_penalties(logits.clone(), states)
    ref0 = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[:1].clone())
    assert torch.allclose(got[0], ref0[0])
    ref1 = logits[1].clone()
    ref1[7] -= 0.5 + 0.25 * 3
    ref1[9] -= 0.5 + 0.25
    assert torch.allclose(got[1], ref1)
    probs = filtered_probs(logits[:1], torch.tensor([0.8]), [0], torch.ones(1), torch.tensor([0.2]))
    warped = MinPLogitsWarper(0.2)(None, TemperatureLogitsWarper(0.8)(None, logits[:1].clone()))
    assert torch.equal(probs[0] > 0, torch.isfinite(warped[0]))


def test_penalised_greedy_avoids_repeats(llm_270m_q):
    plain = llm_270m_q.generate(["1, 1, 1, 1, 1,"], SamplingParams(max_tokens=8))[0].outputs[0].token_ids
    pen = llm_270m_q.generate(["1, 1, 1, 1, 1,"], SamplingParams(max_tokens=8, repetition_penalty=2.0,
                                                               frequency_penalty=1.0))[0].outputs[0].token_ids
    assert plain != pen and len(set(pen)) > len(set(plain))


def test_n_completions_share_prompt_pages_and_are_reproducible(llm_270m_q):
    prompt = "In the beginning of the long and winding report, the committee explained at length " * 4
    params = SamplingParams(max_tokens=8, n=4, temperature=1.0, seed=5)
    before = llm_270m_q.engine._kv.stats().prefix_hit_tokens
    a = llm_270m_q.generate([prompt], params)[0]
    hits = llm_270m_q.engine._kv.stats().prefix_hit_tokens - before
    prompt_len = len(a.prompt_token_ids)
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]
    assert hits >= 3 * ((prompt_len - 1) // 16 * 16)   # siblings reused the first one's prompt pages
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    b = llm_270m_q.generate(["Unrelated", prompt], [SamplingParams(max_tokens=3), params])[1]
    assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]
    greedy = llm_270m_q.generate([prompt], SamplingParams(max_tokens=6, n=3))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


@pytest.mark.parametrize("kwargs, needle", [
    (dict(n=0), "n must be"), (dict(n=65), "n must be"),
    (dict(stop=["x"] * 17), "at most 16 stop strings"), (dict(stop=[""]), "1 to 256"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop=[1]), "stop must be a list"),
    (dict(stop=5), "stop must be a list"),
])
def test_bad_sampling_values(kwargs, needle):
    with pytest.raises(UserInputError, match=needle):
        SamplingParams(**kwargs)


def test_single_stop_string_is_accepted():
    assert SamplingParams(stop="abc").stop == ["abc"] and SamplingParams(stop_token_ids=7).stop_token_ids == [7]


def test_one_bad_request_does_not_affect_others(llm_270m_q):
    eng = llm_270m_q.engine
    good = eng.add_request("Hello there", SamplingParams(max_tokens=4))
    with pytest.raises(UserInputError, match="outside the vocabulary"):
        eng.add_request("Hi", SamplingParams(stop_token_ids=[10**7]))
    with pytest.raises(UserInputError, match="already in use"):
        eng.add_request("Hi", SamplingParams(), request_id=good)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == [good] and len(outs[0].outputs[0].token_ids) == 4


def test_progress_bar_does_not_change_results(llm_270m_q, capsys):
    params = SamplingParams(max_tokens=3)
    plain = llm_270m_q.generate(PROMPTS[:2], params, use_tqdm=False)
    shown = llm_270m_q.generate(PROMPTS[:2], params, use_tqdm=True)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in shown]
    assert "prompts" in capsys.readouterr().err
