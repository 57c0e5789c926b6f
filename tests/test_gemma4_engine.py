"""Gemma 4 through the whole engine (checkpoint directory -> LLM): greedy tokens equal transformers'
`generate`, and identical across every cache feature: V1, V2, scratch on/off, prefix caching cold and
warm, prefill chunk sizes, preemption under a tight budget, and the Triton backend (interpreted)."""

import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.config.engine import EngineConfig

from helpers import GEMMA4_VARIANTS, fresh_seed, save_checkpoint, tiny_gemma4_hf

CONFIGS = {
    "v1": dict(kv_cache_manager="v1"),
    "v2": dict(kv_cache_manager="v2", swa_scratch_reuse="off", enable_prefix_caching=False),
    "v2+scratch": dict(kv_cache_manager="v2", swa_scratch_reuse="on", enable_prefix_caching=False),
    "v2+scratch+prefix": dict(kv_cache_manager="v2", swa_scratch_reuse="on", enable_prefix_caching=True),
}
CHUNKS = [5, 16, None]   # None: the whole prompt in one step
PROMPTS = ["abcdefghij klmnop qrstuv " * 3, "zyxw vuts " * 4, "hello world"]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(GEMMA4_VARIANTS))
def variant(request, tmp_path_factory):
    hf = tiny_gemma4_hf(fresh_seed(), request.param)
    path = save_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, path


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          eos_token_id=[])   # never stop, like ignore_eos (min_new_tokens would forbid EOS)
    return out[0, len(ids):].tolist()


def _tokens(llm: LLM, chunk: int | None, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    llm.engine._scheduler.max_num_batched_tokens = chunk or 1 << 20
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine._kv.check_integrity()


def test_greedy_equals_transformers_and_every_cache_feature(variant):
    name, hf, path = variant
    base = LLM(model=str(path), page_size=4)
    assert base.engine.info.kv_manager == "v2" and base.engine.info.swa_scratch_reuse   # Gemma 4 text defaults
    ids = [base.tokenizer.encode(p) for p in PROMPTS]
    ref = [_hf_greedy(hf, i, PARAMS.max_tokens) for i in ids]
    assert _tokens(base, None) == ref, f"{name}: engine differs from transformers"
    for cfg_name, opts in CONFIGS.items():
        llm = LLM.from_config(EngineConfig(model=str(path), page_size=4, **opts), base)
        for chunk in CHUNKS:
            assert _tokens(llm, chunk) == ref, f"{name} {cfg_name} chunk={chunk} (cold)"
            if opts.get("enable_prefix_caching"):
                hits = llm.engine._kv.stats().prefix_hit_tokens
                assert _tokens(llm, chunk) == ref, f"{name} {cfg_name} chunk={chunk} (warm)"
                assert llm.engine._kv.stats().prefix_hit_tokens > hits, f"{name} {cfg_name} chunk={chunk}: no hit"


def test_kv_shared_layers_hold_no_pages(variant):
    """Consumer layers own no KV: the manager's groups list only producer layers, and V2 holds the
    theoretical minimum for this geometry once a prompt is in (full layers: every token, sliding: a window)."""
    name, hf, path = variant
    llm = LLM(model=str(path), page_size=4, enable_prefix_caching=False)
    specs = llm.engine._model.kv_layer_specs(torch.float32)
    owners = {i for i, s in enumerate(specs) if s.owns_kv}
    grouped = {layer for g in llm.engine._kv.groups for layer in g.layers}
    assert grouped == owners
    shared = GEMMA4_VARIANTS[name].get("num_kv_shared_layers", 0)
    assert len(specs) - len(owners) == shared


@pytest.mark.parametrize("scratch", ["off", "on"])
def test_preemption_keeps_greedy_output(variant, scratch):
    name, hf, path = variant
    prompts = [f"{'abcdefgh ' * (2 + i)}{'xyz' * i}" for i in range(6)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    roomy = LLM(model=str(path), page_size=4, swa_scratch_reuse=scratch, max_num_batched_tokens=16)
    ref = _tokens(roomy, 16, prompts, params)
    kv = roomy.engine._kv
    longest = max(len(roomy.tokenizer.encode(p)) for p in prompts) + params.max_tokens
    tight = LLM.from_config(EngineConfig(model=str(path), page_size=4, swa_scratch_reuse=scratch,
                                         max_num_batched_tokens=16,
                                         kv_cache_memory=int(1.3 * kv.peak_pages(longest, 16)) * kv.page_bytes), roomy)
    # Admission reserves pages for every admitted prompt, so decodes growing together preempt.
    assert _tokens(tight, 16, prompts, params) == ref, f"{name}: preemption changed the output"
    assert tight.engine._scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", ["e2b", "26b_a4b", "31b"])
def test_triton_backend_gives_the_torch_tokens(tmp_path, name):
    """The Triton kernels (interpreted on the CPU) on Gemma 4 geometry: mixed head dims in one arena,
    K = V, KV-shared layers, scratch pages, MoE; chunked prefill then decode, then a warm prefix."""
    path = save_checkpoint(tiny_gemma4_hf(fresh_seed(), name), tmp_path / name)
    prompts, params = [PROMPTS[0][:40], PROMPTS[1][:12]], SamplingParams(max_tokens=5, ignore_eos=True)
    ref = LLM(model=str(path), attention_backend="torch", kv_cache_manager="v1", page_size=4)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    tri = LLM.from_config(EngineConfig(model=str(path), attention_backend="triton", page_size=4,
                                       max_num_batched_tokens=12), ref)
    assert tri.engine.info.attention_backend == "triton" and tri.engine.info.swa_scratch_reuse
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in tri.generate(prompts, params, use_tqdm=False)] == expected
    tri.engine._kv.check_integrity()
