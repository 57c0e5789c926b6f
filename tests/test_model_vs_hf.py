"""Our Gemma 3 logits against transformers' Gemma3ForCausalLM (fp32) on tiny random configs."""

import pytest
import torch

from helpers import fresh_seed, ours_from_hf, paged_logits, tiny_hf_model

TOL = 1e-4

# Each case stresses a different piece of the math; windows are shorter than the prompts.
CASES = {
    "mqa_window4_qpas20_linear_rope": dict(num_key_value_heads=1, sliding_window=4, query_pre_attn_scalar=20,
                                           rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "gqa2_window8_layer_types": dict(num_key_value_heads=2, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                  "sliding_attention", "full_attention", "sliding_attention",
                                                  "sliding_attention"]),
    "mha_headdim32_window5": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=32, sliding_window=5,
                                  query_pre_attn_scalar=32, rope_theta=50_000.0),
    "gqa_qpas_lt_headdim_window16": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                         sliding_window=16, query_pre_attn_scalar=6,
                                         rope_scaling={"rope_type": "linear", "factor": 2.5}),
}


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(params=sorted(CASES))
def case(request):
    seed = fresh_seed()
    hf = tiny_hf_model(seed, **CASES[request.param])
    return request.param, seed, hf, ours_from_hf(hf)


def _random_ids(seed: int, n: int, vocab: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [2] + torch.randint(4, vocab, (n - 1,), generator=g).tolist()


def test_whole_prompt_matches_hf(case):
    name, seed, hf, ours = case
    window = hf.config.sliding_window
    ids = _random_ids(seed, 5 * window + 3)  # several windows long
    ref = _hf_logits(hf, ids)
    got = paged_logits(ours, [ids])[0]
    err = (got - ref).abs().max().item()
    assert err < TOL, f"{name} seed={seed}: max abs diff {err}"


def test_prefill_then_decode_matches_one_forward(case):
    name, seed, hf, ours = case
    window = hf.config.sliding_window
    ids = _random_ids(seed + 1, 4 * window + 7)
    ref = _hf_logits(hf, ids)
    prompt_len = window + 2
    got = paged_logits(ours, [ids], chunk=1, first_chunk=prompt_len)[0]
    err = (got - ref).abs().max().item()
    assert err < TOL, f"{name} seed={seed}: max abs diff {err}"


@pytest.mark.parametrize("chunk", [3, 7])
def test_chunked_prefill_and_batching_match_hf(case, chunk):
    """Several sequences of different lengths in one batch, prefilled in chunks."""
    name, seed, hf, ours = case
    window = hf.config.sliding_window
    seqs = [_random_ids(seed + k, n) for k, n in enumerate((3 * window + 1, window - 1 if window > 2 else 2, 2 * window + 5))]
    got = paged_logits(ours, seqs, chunk=chunk)
    for ids, g in zip(seqs, got):
        err = (g - _hf_logits(hf, ids)).abs().max().item()
        assert err < TOL, f"{name} seed={seed} chunk={chunk} len={len(ids)}: max abs diff {err}"


def test_window_off_by_one_would_be_caught():
    """The tolerance is meaningful: letting a sliding layer see W+1 tokens changes the logits."""
    seed = fresh_seed()
    hf = tiny_hf_model(seed, sliding_window=4)
    ours = ours_from_hf(hf)
    ids = _random_ids(seed, 30)
    import dataclasses

    for layer in ours.model.layers:
        attn = layer.self_attn
        if attn.p.window is not None:
            attn.p = dataclasses.replace(attn.p, window=attn.p.window + 1)
    err = (paged_logits(ours, [ids])[0] - _hf_logits(hf, ids)).abs().max().item()
    assert err > 100 * TOL
