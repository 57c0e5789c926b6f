"""Our Gemma 4 logits (fp32) against transformers' Gemma4ForCausalLM / Gemma4UnifiedForCausalLM, one tiny
random config per released variant: prompts several windows long, prefill then decode, chunked prefill
in batches, and the MoE router's choices per token.

The reference is transformers in float64 (a higher precision than ours; its own fp32 forward lands
~1e-5 from it on these toy models, as ours does).
"""

import copy
import dataclasses

import pytest
import torch

from helpers import GEMMA4_VARIANTS, fresh_seed, ours_from_hf, paged_logits, tiny_gemma4_hf

TOL = 1e-4


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logits in float64 (a float64 copy of `hf`, cached on it)."""
    if not hasattr(hf, "_f64"):
        f64 = copy.deepcopy(hf).double()
        f64.config._experts_implementation = "eager"   # grouped_mm has no float64 kernel
        object.__setattr__(hf, "_f64", f64)
    with torch.no_grad():
        return hf._f64(torch.tensor([ids])).logits[0]


def _random_ids(seed: int, n: int, vocab: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [2] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()


@pytest.fixture(params=sorted(GEMMA4_VARIANTS))
def case(request):
    seed = fresh_seed()
    hf = tiny_gemma4_hf(seed, request.param)
    return request.param, seed, hf, ours_from_hf(hf)


def test_whole_prompt_matches_hf(case):
    name, seed, hf, ours = case
    ids = _random_ids(seed, 6 * hf.config.sliding_window + 3)
    err = (paged_logits(ours, [ids])[0].double() - _hf_logits(hf, ids)).abs().max().item()
    assert err < TOL, f"{name} seed={seed}: max abs diff {err}"


def test_prefill_then_decode_matches_one_forward(case):
    name, seed, hf, ours = case
    window = hf.config.sliding_window
    ids = _random_ids(seed + 1, 5 * window + 4)
    got = paged_logits(ours, [ids], chunk=1, first_chunk=window + 2)[0]
    err = (got.double() - _hf_logits(hf, ids)).abs().max().item()
    assert err < TOL, f"{name} seed={seed}: max abs diff {err}"


@pytest.mark.parametrize("chunk", [3, 7])
def test_chunked_prefill_and_batching_match_hf(case, chunk):
    name, seed, hf, ours = case
    window = hf.config.sliding_window
    seqs = [_random_ids(seed + k, n) for k, n in enumerate((4 * window + 1, window - 1, 2 * window + 5))]
    for scratch in (False, True):
        got = paged_logits(ours, seqs, chunk=chunk, scratch=scratch)
        for ids, g in zip(seqs, got):
            err = (g.double() - _hf_logits(hf, ids)).abs().max().item()
            assert err < TOL, f"{name} seed={seed} chunk={chunk} scratch={scratch} len={len(ids)}: {err}"


def test_moe_routing_equals_hf_per_token():
    """Selected experts (in order) and their weights, per token and layer, against HF's router."""
    seed = fresh_seed()
    hf = tiny_gemma4_hf(seed, "26b_a4b")
    ours = ours_from_hf(hf)
    ids = _random_ids(seed, 40)
    theirs, mine = {}, {}
    hooks = [layer.router.register_forward_hook(lambda m, a, out, i=i: theirs.__setitem__(i, out[1:]))
             for i, layer in enumerate(hf.model.layers)]
    hooks += [layer.router.register_forward_hook(lambda m, a, out, i=i: mine.__setitem__(i, out))
              for i, layer in enumerate(ours.model.layers)]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    paged_logits(ours, [ids])
    for h in hooks:
        h.remove()
    assert sorted(theirs) == sorted(mine) == list(range(len(hf.model.layers)))
    for i in theirs:
        (w_ref, idx_ref), (w, idx) = theirs[i], mine[i]
        assert torch.equal(idx, idx_ref.reshape(idx.shape)), f"layer {i}: experts differ"
        assert torch.allclose(w, w_ref.reshape(w.shape).float(), atol=1e-6), f"layer {i}: weights differ"


def test_the_tolerance_catches_gemma4_pitfalls():
    """Each of these classic mistakes moves the logits far beyond the tolerance: Gemma 3's (1 + w) norm,
    ordinary partial RoPE (rotary-width denominator) instead of proportional, V as a copy of K."""
    seed = fresh_seed()
    hf = tiny_gemma4_hf(seed, "31b")
    ids = _random_ids(seed, 40)
    ref = _hf_logits(hf, ids)

    def err(model) -> float:
        return (paged_logits(model, [ids])[0].double() - ref).abs().max().item()

    ours = ours_from_hf(hf)
    assert err(ours) < TOL
    one_plus_w = ours_from_hf(hf)   # Gemma 4's w read as Gemma 3's zero-centred weights
    for layer in one_plus_w.model.layers:
        layer.kind = dataclasses.replace(layer.kind, offset=1.0)
        attn = layer.self_attn
        attn.p = dataclasses.replace(attn.p, norm=layer.kind)
    ordinary = ours_from_hf(hf)
    d = 32   # the tiny configs' global head dim
    for j in range(ordinary.ropes.num):
        freq = getattr(ordinary.ropes, f"inv_freq_{j}")
        if freq.shape[0] == d // 2:   # full layers: rotate the first D/4 dims with denominator D/4
            rot = d // 4
            table = torch.zeros(d // 2)
            table[: rot // 2] = 1.0 / (1e6 ** (torch.arange(0, rot, 2).float() / rot))
            freq.copy_(table)
    copy_k = ours_from_hf(hf)
    for layer in copy_k.model.layers:
        attn = layer.self_attn
        if attn.p.k_eq_v:
            attn.p = dataclasses.replace(attn.p, value_norm=False)   # V = raw k, not v_norm(raw k)
    assert err(ordinary) > 100 * TOL
    assert err(copy_k) > 100 * TOL
    assert err(one_plus_w) > 100 * TOL
