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
    # code, French, digits, Japanese and a prompt past the sliding window (the first prompt's greedy
    # text is checked by test_generation_is_coherent_text); 24 tokens each: transformers' fp32 270M
    # takes ~0.1 s a token on 2 cores
    prompts = PROMPTS[1:] + [_long_prompt(llm_270m.tokenizer)]
    outs = llm_270m.generate(prompts, SamplingParams(max_tokens=24))
    for out in outs:
        ref = _hf_greedy(hf_270m, out.prompt_token_ids, 24, llm_270m.tokenizer.stop_token_ids)
        assert out.outputs[0].token_ids == ref, f"prompt {out.prompt[:40]!r}"
        assert len(ref) == 24 or ref[-1] in llm_270m.tokenizer.stop_token_ids


def test_batch_equals_each_prompt_alone(llm_270m):
    prompts = [PROMPTS[0], _long_prompt(llm_270m.tokenizer), PROMPTS[3], "Hi"]
    params = SamplingParams(max_tokens=8)
    together = [o.outputs[0].token_ids for o in llm_270m.generate(prompts, params)]
    alone = [llm_270m.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_generation_is_coherent_text(llm_270m_q):
    out = llm_270m_q.generate("The capital of France is", SamplingParams(max_tokens=8))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 8
    assert out.outputs[0].text == llm_270m_q.tokenizer.decode(out.outputs[0].token_ids)
    assert "Paris" in llm_270m_q.generate("Question: What is the capital of France?\nAnswer:",
                                        SamplingParams(max_tokens=8))[0].outputs[0].text


def test_seeded_sampling_is_reproducible_and_batch_independent(llm_270m_q):
    p = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    a = llm_270m_q.generate(["Once upon a time"], p)[0].outputs[0].token_ids
    batch = llm_270m_q.generate(["Hello there", "Once upon a time", "Zebras"],
                              [SamplingParams(max_tokens=5, temperature=1.0), p, SamplingParams(max_tokens=8)])
    assert batch[1].outputs[0].token_ids == a
    other = llm_270m_q.generate(["Once upon a time"], p.replace(seed=4321))[0].outputs[0].token_ids
    assert other != a


@pytest.mark.parametrize("max_num_batched_tokens", [16, 64])
def test_chunked_prefill_gives_same_tokens(llm_270m_q, max_num_batched_tokens):
    prompt = _long_prompt(llm_270m_q.tokenizer)
    ref = llm_270m_q.generate([prompt], SamplingParams(max_tokens=8))[0].outputs[0].token_ids
    engine = llm_270m_q.engine
    old = engine._scheduler.max_num_batched_tokens
    engine._scheduler.max_num_batched_tokens = max_num_batched_tokens
    try:
        got = llm_270m_q.generate([prompt], SamplingParams(max_tokens=8))[0].outputs[0].token_ids
    finally:
        engine._scheduler.max_num_batched_tokens = old
    assert got == ref


# -- the config both sides run with ------------------------------------------------------------------
# The parity tests above build the transformers reference from our own parsed GGUF config, so a parsing
# mistake (a RoPE base, an epsilon, the window, a soft-cap...) would sit on both sides and pass. These
# check the config the reference runs with against sources that share none of our parsing.

_S, _F = "sliding_attention", "full_attention"
# google/gemma-3-270m's published config.json (the model the GGUF was converted from), transformers>=5
# spelling: rope_theta 1e6 on full layers, rope_local_base_freq 1e4 on sliding ones, a full layer every
# 6th (_sliding_window_pattern 6), no soft-caps. The GGUF's own metadata agrees where it carries a value
# (context_length 32768, embedding_length 640, block_count 18, feed_forward_length 2048, head_count 4,
# head_count_kv 1, key_length 256, layer_norm_rms_epsilon 1e-6 as f32, rope.freq_base 1e6,
# sliding_window 512; token_embd 262144 rows); llama.cpp hard-codes the rest for gemma3.
PUBLISHED_270M = dict(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
    max_position_embeddings=32768, final_logit_softcapping=None, attn_logit_softcapping=None,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
    layer_types=([_S] * 5 + [_F]) * 3,
    rope_parameters={_F: {"rope_type": "default", "rope_theta": 1e6},
                     _S: {"rope_type": "default", "rope_theta": 1e4}},
)


def _rope(params) -> dict:
    """Per layer type: (type, theta, factor), whatever else the config keeps there."""
    return {t: (p.get("rope_type", "default"), float(p["rope_theta"]), float(p.get("factor", 1.0)))
            for t, p in params.items()}


def _config_mismatches(cfg, expected: dict) -> list[str]:
    bad = []
    for key, want in expected.items():
        got = getattr(cfg, key, "<missing>")
        if key == "rope_parameters":
            got, want = _rope(got), _rope(want)
        if isinstance(want, float):
            ok = isinstance(got, (int, float)) and got == pytest.approx(want, rel=1e-6)
        else:
            ok = (list(got) if isinstance(want, list) else got) == want
        if not ok:
            bad.append(f"{key}: {got!r}, expected {want!r}")
    return bad


def test_reference_config_is_the_published_270m(llm_270m, hf_270m):
    """The transformers reference and our model run with google/gemma-3-270m's published values."""
    assert _config_mismatches(hf_270m.config, PUBLISHED_270M) == []
    ours = llm_270m.engine._model.config
    assert (ours.rope_global.theta, ours.rope_global.factor, ours.rope_local.theta, ours.rope_local.factor) \
        == (1e6, 1.0, 1e4, 1.0)
    assert ours.to_hf_dict()["layer_types"] == PUBLISHED_270M["layer_types"]
    assert ours.query_pre_attn_scalar == 256 and ours.final_logit_softcapping is None
    assert ours.rms_norm_eps == pytest.approx(1e-6, rel=1e-6) and ours.sliding_window == 512


def test_reference_config_is_what_transformers_reads_from_the_gguf(hf_270m, gguf_read_once):
    """transformers' own GGUF loader (the gguf package's reader and transformers' gemma3 key mapping and
    defaults; ~10-30 s: it parses the 262k-entry vocabulary) reads the same config from the file."""
    from transformers import AutoConfig

    from gemmaserve.models.embedded import resolve_embedded

    path = resolve_embedded("gemma3-270m")
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert theirs.model_type == "gemma3_text"
    expected = {key: getattr(theirs, key) for key in PUBLISHED_270M}
    assert _config_mismatches(hf_270m.config, expected) == []
