"""Tensor parallelism on the CPU: two ranks (this process and one spawned worker, gloo) give the same
greedy tokens as one process, for Gemma 3 and Gemma 4 tiny configs; plans survive the trip to the
workers whole; bad sizes and dead workers are clear errors."""

from __future__ import annotations

import dataclasses
import pickle
import re

import numpy as np
import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.cli import main
from gemmaserve.engine.media.items import MediaItem
from gemmaserve.models.multimodal import Modality
from gemmaserve.engine.step import NewRequest, SeqStep, SlotUpdate, StepPlan, TableDelta
from gemmaserve.engine.structured.structured_output import GrammarKind, StructuredOutput
from gemmaserve.errors import UserInputError
from gemmaserve.kv.connector import BlockCopy, Direction, KVTransfers

from helpers import fresh_seed, save_checkpoint, tiny_gemma4_hf, tiny_hf_model

PROMPTS = ["the quick brown fox jumps over the lazy dog", "abc def ghi jkl mno pqr stu vwx", "hello there"]


def _greedy(path, tp: int, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=tp, kv_cache_memory=1 << 22, max_num_batched_tokens=8,
              **options)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    assert all(o.outputs[0].finish_reason == "length" for o in out), [o.outputs[0].error for o in out]
    return [o.outputs[0].token_ids for o in out], llm


def _kv_heads(llm: LLM) -> set[int]:
    """KV heads per layer in this process's cache ([pages, tokens, heads, dim] views)."""
    runner = llm.engine._runner
    runner = getattr(runner, "runner", runner)   # rank 0's own runner under tensor parallelism
    return {k.shape[2] for k, _ in runner.kv_cache}


@pytest.mark.parametrize("family", ["gemma3", "gemma3_untied", "gemma4_moe", "gemma4_e2b"])
def test_two_ranks_give_the_tokens_of_one(tmp_path, family):
    """gemma3: one KV head (replicated on both ranks), vocabulary 301 (padded to 2 x 151), prompts
    several windows long in 8-token chunks. gemma4_moe (26B-A4B shape): MoE experts split, sliding
    layers' 2 KV heads split and the full layers' single one replicated, soft-capped logits.
    gemma4_e2b: per-layer embeddings, KV-shared layers, asynchronous scheduling (the next step's
    input is each rank's own sampled token). gemma3_untied: an output head apart from the embedding,
    sharded over the vocabulary as the embedding is."""
    seed = fresh_seed()
    if family.startswith("gemma3"):
        hf, options = tiny_hf_model(seed, vocab_size=301, tie_word_embeddings=family == "gemma3"), {}
    elif family == "gemma4_moe":
        hf, options = tiny_gemma4_hf(seed, "26b_a4b"), {}
    else:
        hf, options = tiny_gemma4_hf(seed, "e2b"), {"async_scheduling": "on"}
    path = save_checkpoint(hf, tmp_path / family)
    want, one = _greedy(path, 1, **options)
    threads = torch.get_num_threads()
    got, two = _greedy(path, 2, **options)
    try:
        assert got == want
        if family == "gemma3":   # every rank samples: each keeps its own grammar in step
            pytest.importorskip("xgrammar")
            regex = SamplingParams(max_tokens=12, temperature=1.0, seed=seed,
                                   structured_output=StructuredOutput(GrammarKind.REGEX, "[a-z]{2,5} [0-9]+"))
            texts = [[o.outputs[0].text for o in llm.generate(PROMPTS, regex)] for llm in (one, two)]
            assert texts[0] == texts[1] and all(re.fullmatch("[a-z]{2,5} [0-9]+", t) for t in texts[0]), texts
        heads_one, heads_two = _kv_heads(one), _kv_heads(two)
        if family == "gemma4_moe":   # each rank stores half of the split KV heads; the replicated one whole
            assert heads_one == {1, 2} and heads_two == {1}
        else:
            assert heads_two == heads_one == {1}
        assert two.engine.info.tensor_parallel_size == 2
        two.engine._kv.check_integrity()
    finally:
        two.engine.shutdown()
    assert not two.engine._executor.procs[0].is_alive()
    assert torch.get_num_threads() == threads   # rank 0 gave its share of the cores back


def _every_field_set() -> SamplingParams:
    """SamplingParams with no field at its default (so a field the trip drops shows)."""
    params = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=-0.5, seed=11, n=2, stop=["x", "yz"],
                            stop_token_ids=[3, 4], logprobs=2, skip_special_tokens=False,
                            structured_output=StructuredOutput(GrammarKind.REGEX, "[a-z]+"), speculative=False)
    defaults = SamplingParams()
    same = [f.name for f in dataclasses.fields(SamplingParams) if getattr(params, f.name) == getattr(defaults, f.name)]
    assert same == ["ignore_eos"], same   # ignore_eos=True cannot go with structured output
    return params


def test_a_plan_reaches_a_worker_whole():
    """What the executor sends (pickled to_dict) rebuilds every field: sequences and deltas, slot
    updates, releases, every SamplingParams field, and images and clips with their arrays."""
    image = MediaItem(3, 4, "ab" * 16, np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4),
                      np.arange(8, dtype=np.int64).reshape(4, 2))
    clip = MediaItem(9, 2, "cd" * 16, np.ones((5, 3), dtype=np.float32), np.array([True] * 4 + [False]),
                     Modality.AUDIO, bidirectional=False)
    plan = StepPlan(
        step=5,
        seqs=[SeqStep("a", 0, [5, 6, 7], True, [TableDelta(0, [1, 2]), TableDelta(2, [])], True),
              SeqStep("b", 9, [-1], False)],
        new_requests=[NewRequest("a", _every_field_set(), 123, [5, 6, 7], [image, clip], [9, 8])],
        slot_updates=[SlotUpdate(1, [4, 5], [[1, 2], [3, 4]])],
        released=["c"], finished=["d"],
        kv_transfers=KVTransfers([BlockCopy(Direction.SAVE, 1, [3, 4], [0, 1]), BlockCopy(Direction.LOAD, 0, [5], [2])]))
    back = StepPlan.from_dict(pickle.loads(pickle.dumps(plan.to_dict())))
    assert back.new_requests[0].params == plan.new_requests[0].params
    for got, want in zip(back.new_requests[0].media, [image, clip], strict=True):
        assert (got.start, got.length, got.key, got.modality, got.bidirectional) == \
            (want.start, want.length, want.key, want.modality, want.bidirectional)
        assert np.array_equal(got.data, want.data) and got.data.dtype == want.data.dtype
        assert np.array_equal(got.extra, want.extra) and got.extra.dtype == want.extra.dtype
    back.new_requests[0].media, plan.new_requests[0].media = [], []   # arrays have no ==
    assert back == plan


def test_bad_tensor_parallel_sizes_are_clear_errors(tmp_path, capsys):
    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "g3")   # 4 heads, 1 KV head, intermediate 96
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(UserInputError, match="tensor_parallel_size must be a positive integer"):
            LLM(str(path), tensor_parallel_size=bad)
    with pytest.raises(UserInputError, match="does not divide the 4 attention heads"):
        LLM(str(path), tensor_parallel_size=3)
    with pytest.raises(UserInputError, match="fp8 is not supported"):
        LLM(str(path), tensor_parallel_size=2, kv_cache_dtype="fp8")
    assert main(["generate", "--model", str(path), "--tensor-parallel-size", "8", "hi"]) == 2
    assert "does not divide the 4 attention heads" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--tensor-parallel-size", "0", "hi"])
    assert exc.value.code == 2
    assert "--tensor-parallel-size: must be >= 1" in capsys.readouterr().err


def test_a_dead_worker_fails_requests_with_a_clear_error(tmp_path):
    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "g3")
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, kv_cache_memory=1 << 22)
    try:
        worker = llm.engine._executor.procs[0]
        worker.kill()
        worker.join(10)
        out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4))
        for o in out:
            assert o.outputs[0].finish_reason == "error"
            assert "tensor-parallel rank 1 exited with code -9" in o.outputs[0].error
        again = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))[0].outputs[0]
        assert again.finish_reason == "error" and "must be restarted" in again.error
    finally:
        llm.engine.shutdown()


def test_embedded_gguf_quantised_two_ranks_match_one():
    """The embedded 270M on its default CPU path: GGUF tensors dequantised then sliced, Q4_K groups
    sliced exactly, int8 kernels and the fbgemm head per shard; greedy tokens equal one process's."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=8)
    one = LLM(max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    del one
    two = LLM(max_num_seqs=4, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == want
        assert "int4" in two.engine.info.weights   # the sliced Q4_K groups stayed 4-bit
    finally:
        two.engine.shutdown()
