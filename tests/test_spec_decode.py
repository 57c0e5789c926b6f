"""Speculative decoding with prompt lookup (`--speculative-config '{"method": "ngram", ...}'`): the same
output as one token per step in every cache mode, with sampling, stops, logprobs, grammars and n > 1;
the proposer against brute force; verification keeps the target's distribution."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.config.engine import EngineConfig
from gemmaserve.config.speculative import SpeculativeConfig
from gemmaserve.engine.spec_decode.proposers import NgramProposer
from gemmaserve.engine.sampler import SamplingState
from gemmaserve.engine.spec_decode.verify import verify
from gemmaserve.errors import UserInputError

from helpers import check_grammar_cut, check_warm_rerun, fresh_seed, save_checkpoint, tiny_hf_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 64}


def _brute_force(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):   # the latest earlier occurrence
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposer_equals_brute_force():
    rng = random.Random(fresh_seed())
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        k, hi = rng.randrange(1, 6), rng.randrange(1, 5)
        lo = rng.randrange(1, hi + 1)
        limit = rng.randrange(0, 7)
        got = NgramProposer(k, hi, lo).lookup(tokens, limit)
        assert got == _brute_force(tokens, min(k, limit), hi, lo), (tokens, k, hi, lo, limit)
    assert NgramProposer(3, 2, 1).lookup([5, 6, 7, 5, 6], 10) == [7, 5, 6]


def test_speculative_config_is_checked():
    want = SpeculativeConfig("ngram", 4, 3, 1, None, 64)
    assert EngineConfig(speculative_config=dict(NGRAM)).speculative_config == want
    default = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}').speculative_config
    assert default == SpeculativeConfig("ngram", 2, 4, 2, None, None)
    # the batch above which steps stop drafting: the device's measured default, unless given
    assert [default.for_device(d).disable_by_batch_size for d in ("cpu", "cuda")] == [4, 8]
    assert want.for_device("cuda") == want
    for bad, match in [('{"method": "ngram"', "not valid JSON"), ({"method": "eagle"}, "method must be"),
                       ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
                       ({"method": "ngram", "num_speculative_tokens": 0}, r"in \[1, 16\]"),
                       ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_min <= prompt_lookup_max"),
                       ({**NGRAM, "draft": 1}, "unknown key"), ({**NGRAM, "model": "x"}, "takes no model"),
                       ({**NGRAM, "disable_by_batch_size": 0}, "disable_by_batch_size")]:
        with pytest.raises(UserInputError, match=match):
            EngineConfig(speculative_config=bad)
    with pytest.raises(UserInputError, match="speculative must be"):
        SamplingParams(speculative="no")


def test_command_line_says_what_is_wrong_with_the_config(capsys):
    from gemmaserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}', "hi"])
    assert exit_.value.code == 2
    assert "--speculative-config: speculative config: num_speculative_tokens must be" in capsys.readouterr().err


def test_verification_keeps_the_target_distribution():
    """First emitted token of a verified step, over many draws: the target's filtered distribution
    (chi-squared), whether the draft is its likeliest token, an unlikely one or one top-k removes;
    and the same draws as sampling without a draft (one generator draw per emitted token)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    vocab, draws = 12, 1500
    logits = torch.randn(2, vocab, generator=gen) * 1.5
    for params in (SamplingParams(temperature=0.9), SamplingParams(temperature=1.3, top_k=6, top_p=0.9),
                   SamplingParams(temperature=0.7, min_p=0.05)):
        state = SamplingState.create(params, 1234, [1, 2], torch.device("cpu"))
        plain = SamplingState.create(params, 1234, [1, 2], torch.device("cpu"))
        from gemmaserve.engine.sampler import filtered_probs, sample

        p = filtered_probs(logits[:1], torch.tensor([params.temperature]), [params.top_k],
                           torch.tensor([params.top_p]), torch.tensor([params.min_p]))[0].double()
        for draft in (int(p.argmax()), int(p.argsort()[vocab // 2]), int(p.argmin())):
            counts = torch.zeros(vocab, dtype=torch.float64)
            for _ in range(draws):
                got = verify(logits, [2], [[draft]], [state])
                first = got.tokens[0][0]
                counts[first] += 1
                ref = sample(logits[:1], [plain]).resolve()[0][0]
                assert first == ref   # the same draw as without the draft
                if first == draft:   # accepted: the second position was drawn from as well
                    assert len(got.tokens[0]) == 2 and sample(logits[1:], [plain]).resolve()[0][0] == got.tokens[0][1]
                else:
                    assert len(got.tokens[0]) == 1
            keep = p > 0
            expected = p[keep] * draws
            chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
            dof = int(keep.sum()) - 1
            assert counts[~keep].sum() == 0
            assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (params, draft, chi2, dof)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_checkpoint(tiny_hf_model(21, sliding_window=6, num_key_value_heads=2),
                           tmp_path_factory.mktemp("spec") / "tiny")
    return str(path), LLM(model=str(path), page_size=4)


PROMPTS = ["abcdefghij klmnop qrstuv " * 6, "zyxw vuts " * 5, "hello world " * 3, "one two three four five"]
MODES = {
    "v1": dict(kv_cache_manager="v1"),
    "v2+scratch+prefix": dict(kv_cache_manager="v2", swa_scratch_reuse="on", enable_prefix_caching=True),
    "v2 chunk 8": dict(kv_cache_manager="v2", enable_prefix_caching=False, max_num_batched_tokens=8),
    "preempting": dict(kv_cache_manager="v2", kv_cache_memory=70 * 1024, max_num_batched_tokens=16),
    "async": dict(kv_cache_manager="v2", async_scheduling="on"),
    "fp8 kv": dict(kv_cache_dtype="fp8"),
}


def _rows(outs) -> list:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
             [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs or []]) for o in outs for c in o.outputs]


def _run(path, base, opts, params, spec: bool, prompts=PROMPTS):
    """The rows of `prompts` on a new engine with `opts` (KV integrity checked), and the LLM."""
    config = EngineConfig(model=path, page_size=4, **opts, speculative_config=dict(NGRAM) if spec else None)
    llm = LLM.from_config(config, base)
    outs = llm.generate(prompts, params)
    llm.engine._kv.check_integrity()
    return _rows(outs), llm


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_tokens_equal_without_speculation_in_every_cache_mode(tiny, mode):
    path, base = tiny
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref, _ = _run(path, base, MODES[mode], params, spec=False)
    got, llm = _run(path, base, MODES[mode], params, spec=True)
    assert got == ref
    eng = llm.engine
    st = eng._scheduler.spec_stats
    assert st.accepted > 0 and st.accepted < st.drafted, st   # drafts both kept and rejected: both paths ran
    if mode == "preempting":
        assert eng._scheduler.num_preemptions > 0
        # Counters users read agree under preemption: per request (--json, usage) and in total (/metrics).
        from gemmaserve.server.metrics import ServerMetrics

        llm = LLM.from_config(eng.config, base)
        outs = llm.generate(PROMPTS, params)
        stats = llm.engine._scheduler.spec_stats
        assert llm.engine._scheduler.num_preemptions > 0 and stats.accepted > 0
        assert sum(c.num_draft_tokens for o in outs for c in o.outputs) == stats.drafted == sum(stats.drafted_at)
        assert sum(c.num_accepted_tokens for o in outs for c in o.outputs) == stats.accepted == sum(stats.accepted_at)
        snap = llm.engine.snapshot()
        assert snap.spec == stats and snap.spec.accepted_at is not stats.accepted_at   # a copy: later steps leave it
        text = ServerMetrics().render(snap).decode()
        assert f"gemmaserve_spec_decode_num_accepted_tokens_total {float(stats.accepted)}" in text
        assert (f'gemmaserve_spec_decode_num_draft_tokens_per_pos_total{{position="0"}} '
                f"{float(stats.drafted_at[0])}") in text
    if mode == "v2+scratch+prefix":   # warm: the same tokens and drafts from prefix hits
        check_warm_rerun(llm, PROMPTS, params, ref, _rows)


SAMPLING = {
    "seeded-filters-logprobs": dict(temperature=0.8, seed=7, top_k=20, top_p=0.95, min_p=0.01, logprobs=2),
    "penalties-n3": dict(temperature=1.0, seed=3, repetition_penalty=1.3, presence_penalty=0.5,
                         frequency_penalty=0.3, n=3),
    "stop-strings": dict(stop=["qr", " fi"], logprobs=1),
    "max-tokens": dict(max_tokens=7),
    "stop-token": dict(),   # the 10th greedy token of the first prompt, inside an accepted run
}


@pytest.mark.parametrize("case", sorted(SAMPLING))
def test_sampling_stops_and_logprobs_equal_without_speculation(tiny, case):
    path, base = tiny
    params = SamplingParams(**{"max_tokens": 30, **SAMPLING[case]})
    if case == "stop-token":
        ref, _ = _run(path, base, {}, params.replace(ignore_eos=True), spec=False)
        params = params.replace(stop_token_ids=[ref[0][0][9]])
    ref, _ = _run(path, base, {}, params, spec=False)
    got, llm = _run(path, base, {}, params, spec=True)
    assert got == ref
    assert llm.engine._scheduler.spec_stats.drafted > 0


def test_streams_structured_output_and_opt_out(tiny):
    path, base = tiny
    spec = LLM.from_config(EngineConfig(model=path, page_size=4, speculative_config=dict(NGRAM)), base)
    plain = LLM.from_config(EngineConfig(model=path, page_size=4), base)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    deltas: dict[int, list] = {}
    for o in spec.stream(PROMPTS[:2], params):
        deltas.setdefault(o.prompt_index, []).extend(o.outputs[0].delta_token_ids)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:2], params)]
    assert [deltas[0], deltas[1]] == want
    assert max(spec.engine._scheduler.spec_stats.accepted_at or [0]) > 0
    regex = SamplingParams(max_tokens=16, structured_output={"kind": "regex", "spec": "(ab|cd)+x"})
    before = spec.engine._scheduler.spec_stats.accepted
    assert ([o.outputs[0].text for o in spec.generate(PROMPTS[:2], regex)]
            == [o.outputs[0].text for o in plain.generate(PROMPTS[:2], regex)])
    assert spec.engine._scheduler.spec_stats.accepted > before   # drafts the grammar allows were kept
    before = spec.engine._scheduler.spec_stats.drafted
    out = spec.generate(PROMPTS[:1], params.replace(speculative=False))
    assert spec.engine._scheduler.spec_stats.drafted == before and out[0].outputs[0].token_ids == want[0]
    # Above disable_by_batch_size running decodes, steps draft nothing (and the tokens stay the same).
    capped = LLM.from_config(EngineConfig(model=path, page_size=4,
                                          speculative_config={**NGRAM, "disable_by_batch_size": 1}), base)
    outs = capped.generate(PROMPTS[:2], params.replace(max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == [w[:12] for w in want]
    assert capped.engine._scheduler.spec_stats.drafted == 0


def test_drafts_the_grammar_forbids_never_reach_the_forward(tiny):
    """Structured output with prompt lookup: a draft the request's grammar forbids, and every draft after
    it, is cut before the target's forward (the statistics count only what was verified); the text is
    what it is without speculation."""
    path, base = tiny
    check_grammar_cut(path, base, dict(NGRAM), PROMPTS[:3], 24)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_counters_agree_when_requests_are_aborted_mid_speculation(tiny, async_scheduling):
    """Aborts with drafts in flight (verified by the step just done, or in the step launched under asynchronous
    scheduling), beside requests that go on: the survivors' tokens, the aborted ones' pages freed at once, and
    the totals /metrics reads equal to the sum of every request's own counters (usage, --json), aborted ones
    included: check_aborts_mid_speculation."""
    from helpers import check_aborts_mid_speculation

    path, base = tiny
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, params)]
    engine = LLM.from_config(EngineConfig(model=path, page_size=4, async_scheduling=async_scheduling,
                                          speculative_config=dict(NGRAM)), base).engine
    check_aborts_mid_speculation(engine, PROMPTS, params, want)


def test_drafting_requests_verify_together_under_asynchronous_scheduling(tiny):
    """With a step in flight, the drafting requests wait for it together: prompts that finish prefilling in
    different steps do not leave them split into groups verifying in alternate steps (each group at half
    the tokens per forward). Drafts are each request's own greedy continuation, so every one is right."""
    from gemmaserve.testing.replay_drafts import ReplayDrafts

    path, base = tiny
    params = SamplingParams(max_tokens=21, ignore_eos=True)
    want = base.generate(PROMPTS, params)
    llm = LLM.from_config(EngineConfig(model=path, page_size=4, async_scheduling="on", max_num_batched_tokens=24,
                                       speculative_config=dict(NGRAM)), base)
    sched = llm.engine._scheduler
    sched.proposer = ReplayDrafts(4, {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in want}, 1.0,
                                  llm.engine._model.vocab_size)
    drafts: list[list[int]] = []   # per launched step, the drafts of each sequence in it
    launch = llm.engine._runner.launch
    llm.engine._runner.launch = lambda plan, only=None: drafts.append([s.num_drafts for s in plan.seqs]) or launch(
        plan, only)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == [o.outputs[0].token_ids for o in want]
    together = [sum(1 for n in d if n) for d in drafts if any(d)]   # sequences verifying, per step
    first = together.index(len(PROMPTS))   # every prompt is in: from here on the group only shrinks (finishing)
    assert together[first:] == sorted(together[first:], reverse=True), drafts


def test_270m_copies_its_input_faster_with_the_same_tokens(llm_270m_q):
    prompt = ("Copy the list exactly.\nList: apples, oranges, pears, plums, grapes, cherries, lemons, limes, "
              "figs, dates.\nCopy: apples, oranges, pears, plums,")
    params = SamplingParams(max_tokens=24)
    spec = LLM.from_config(llm_270m_q.engine.config.replace(speculative_config=dict(NGRAM)), llm_270m_q)
    got = spec.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == llm_270m_q.generate([prompt], params)[0].outputs[0].token_ids
    st = spec.engine._scheduler.spec_stats
    assert st.mean_accepted_length > 2, st   # the list is copied: most drafts are right


def test_two_tensor_parallel_ranks_verify_alike(tiny):
    """Every rank runs the verification (same logits, same sampling state), so every rank keeps the
    same drafts: greedy and seeded tokens equal one process without speculation."""
    path, base = tiny
    two = LLM(path, page_size=4, tensor_parallel_size=2, speculative_config=dict(NGRAM))
    try:
        for params in (SamplingParams(max_tokens=20, ignore_eos=True),
                       SamplingParams(max_tokens=20, temperature=0.9, seed=5, ignore_eos=True)):
            want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, params)]
            assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params)] == want
        assert two.engine._scheduler.spec_stats.accepted > 0
    finally:
        two.engine.shutdown()


def test_bench_spec_runs_and_checks_tokens(tiny, tmp_path):
    """`bench spec` on a tiny checkpoint (no GGUF: llama.cpp is skipped with a note): a task row and a batch
    row, ours with and without drafts giving the same tokens."""
    import argparse
    import json

    from gemmaserve.bench import spec
    from gemmaserve.config.options import add_options

    path, _ = tiny
    parser = argparse.ArgumentParser()
    spec.add_arguments(parser)
    add_options(parser, EngineConfig, "engine")
    out = tmp_path / "spec.json"
    args = parser.parse_args(["--model", path, "--page-size", "4", "--cpu-compile", "off", "--tasks", "code-rename",
                              "--new-tokens", "8", "--repeats", "1", "--batch-sizes", "2", "--out", str(out)])
    assert spec.run(args) == 0
    res = json.loads(out.read_text())
    assert [r["task"] for r in res["tasks"]] == ["code-rename"] and res["tasks"][0]["same_tokens"]
    assert [(r["workload"], r["batch"]) for r in res["batches"]] == [("grounded", 2), ("free", 2)]
    assert all(r["same_tokens"] for r in res["batches"])
    assert res["llama_cpp"].startswith("skipped") and not res["failed"]


def test_multi_turn_sessions_keep_their_prefix_hits(tiny):
    """Interleaved multi-turn sessions (each turn is the last prompt + its answer + more text): with drafts
    the prefix cache serves the same tokens as without (only accepted tokens' blocks are cached, all of them)."""
    path, base = tiny
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    stats = {}
    for spec in (None, dict(NGRAM)):
        llm = LLM.from_config(EngineConfig(model=path, page_size=4, enable_prefix_caching=True,
                                           speculative_config=spec), base)
        sessions = [p[:60] for p in PROMPTS]
        answers = []
        for turn in range(3):
            outs = llm.generate(sessions, params)
            answers.append([o.outputs[0].text for o in outs])
            sessions = [s + o.outputs[0].text + f" turn {turn} " for s, o in zip(sessions, outs)]
        st = llm.engine._kv.stats()
        stats[spec is not None] = (answers, st.prefix_query_tokens, st.prefix_hit_tokens)
        llm.engine._kv.check_integrity()
        accepted = llm.engine._scheduler.spec_stats.accepted
    assert stats[True] == stats[False] and stats[True][2] > 0 and accepted > 0


def test_an_http_request_opts_out_with_speculative_false():
    from gemmaserve.server.protocol import ChatRequest, CompletionRequest, sampling_params

    assert sampling_params(CompletionRequest(prompt="hi"), 8).speculative is True
    assert sampling_params(CompletionRequest(prompt="hi", speculative=False), 8).speculative is False
    chat = ChatRequest(messages=[{"role": "user", "content": "hi"}], speculative=False)
    assert sampling_params(chat, 8).speculative is False


@pytest.mark.parametrize("variant,backend", [("gemma3", "torch"), ("e2b", "torch"), ("31b", "triton")])
def test_a_verification_step_as_a_decode_batch_gives_the_same_logits(variant, backend):
    """CUDA graphs replay a verification step as a decode batch of one row per token (runner's
    `verification_as_decode`): its logits are the multi-token step's, sliding windows and KV-shared layers
    included (the Triton kernels under the interpreter here)."""
    from gemmaserve.attention.base import AttentionMetadata
    from gemmaserve.engine.model_runner import verification_as_decode
    from gemmaserve.engine.step import SeqStep
    from gemmaserve.models.base import ModelInputs

    from helpers import ours_from_hf, paged_kv, tiny_gemma4_hf

    seed = fresh_seed()
    hf = tiny_hf_model(seed, sliding_window=6) if variant == "gemma3" else tiny_gemma4_hf(seed, variant)
    model = ours_from_hf(hf)
    kv, backend, cache = paged_kv(model, backend, 600)
    rng = random.Random(seed)
    prompt = [2] + [rng.randrange(3, 300) for _ in range(22)]
    n, rows = len(prompt), [rng.randrange(3, 300) for _ in range(4)]   # the last token and 3 drafts

    def logits(md, ids, positions):
        with torch.inference_mode():
            return model.compute_logits(model(ModelInputs(torch.tensor(ids), torch.tensor(positions),
                                                          backend.begin_batch(md, cache))))

    assert kv.allocate("s", prompt, 0, n, prefill=True)
    logits(AttentionMetadata([n], [n], kv.group_tables(["s"]), kv.layer_slot), prompt, list(range(n)))
    kv.commit("s", prompt, n)
    assert kv.allocate("s", prompt + rows, n, n + 4, prefill=False)
    step = AttentionMetadata([4], [n + 4], kv.group_tables(["s"]), kv.layer_slot)
    want = logits(step, rows, list(range(n, n + 4)))
    as_decode = verification_as_decode([SeqStep("s", n, rows, True, num_drafts=3)], step)
    assert as_decode.query_lens == [1] * 4 and as_decode.seq_lens == [n + 1, n + 2, n + 3, n + 4]
    got = logits(as_decode, rows, list(range(n, n + 4)))
    assert (got - want).abs().max().item() < 1e-5, (variant, (got - want).abs().max().item())
    assert verification_as_decode([SeqStep("s", n, rows, True)], step) is None   # a prefill chunk stays as it is
