"""The real Gemma 3 270M (embedded GGUF): greedy tokens equal transformers' on the same weights."""

import pytest
import torch

from gemmaserve import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Les sciences naturelles étudient",
    "1, 1, 2, 3, 5, 8, 13,",
    "日本の首都は",
]


def _long_prompt(tokenizer) -> str:
    """A prompt longer than the 512-token window of the sliding layers."""
    text = ("The history of the river valley is long. Farmers settled on its banks, built mills and "
            "traded grain with the towns downstream. ") * 30 + "Summarising the story above,"
    assert len(tokenizer.encode(text)) > 600
    return text


def _hf_greedy(hf, prompt_ids: list[int], n: int, stop_ids) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=sorted(stop_ids), pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_matches_transformers(llm_270m, hf_270m):
    prompts = PROMPTS + [_long_prompt(llm_270m.tokenizer)]
    outs = llm_270m.generate(prompts, SamplingParams(max_tokens=32))
    for out in outs:
        ref = _hf_greedy(hf_270m, out.prompt_token_ids, 32, llm_270m.tokenizer.stop_token_ids)
        assert out.outputs[0].token_ids == ref, f"prompt {out.prompt[:40]!r}"
        assert len(ref) == 32 or ref[-1] in llm_270m.tokenizer.stop_token_ids


def test_batch_equals_each_prompt_alone(llm_270m):
    prompts = [PROMPTS[0], _long_prompt(llm_270m.tokenizer), PROMPTS[3], "Hi"]
    params = SamplingParams(max_tokens=12)
    together = [o.outputs[0].token_ids for o in llm_270m.generate(prompts, params)]
    alone = [llm_270m.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_generation_is_coherent_text(llm_270m):
    out = llm_270m.generate("The capital of France is", SamplingParams(max_tokens=8))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 8
    assert out.outputs[0].text == llm_270m.tokenizer.decode(out.outputs[0].token_ids)
    assert "Paris" in llm_270m.generate("Question: What is the capital of France?\nAnswer:",
                                        SamplingParams(max_tokens=8))[0].outputs[0].text


def test_seeded_sampling_is_reproducible_and_batch_independent(llm_270m):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    a = llm_270m.generate(["Once upon a time"], p)[0].outputs[0].token_ids
    batch = llm_270m.generate(["Hello there", "Once upon a time", "Zebras"],
                              [SamplingParams(max_tokens=5, temperature=1.0), p, SamplingParams(max_tokens=20)])
    assert batch[1].outputs[0].token_ids == a
    other = llm_270m.generate(["Once upon a time"], p.replace(seed=4321))[0].outputs[0].token_ids
    assert other != a


@pytest.mark.parametrize("max_num_batched_tokens", [16, 64])
def test_chunked_prefill_gives_same_tokens(llm_270m, max_num_batched_tokens):
    prompt = _long_prompt(llm_270m.tokenizer)
    ref = llm_270m.generate([prompt], SamplingParams(max_tokens=8))[0].outputs[0].token_ids
    engine = llm_270m.engine
    old = engine.scheduler.max_num_batched_tokens
    engine.scheduler.max_num_batched_tokens = max_num_batched_tokens
    try:
        got = llm_270m.generate([prompt], SamplingParams(max_tokens=8))[0].outputs[0].token_ids
    finally:
        engine.scheduler.max_num_batched_tokens = old
    assert got == ref
