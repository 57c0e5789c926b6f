"""Every cache feature leaves greedy output unchanged: V1, V2, V2 + scratch, prefix caching off and
on (cold and warm), and prefill chunks of 16, 64, 512 tokens or the whole prompt, for prompts several
sliding windows long.

The full matrix runs on tiny random models (fixed seeds, windows of a few tokens, so prompts span
many windows and pages); the real 270M runs one comparison per feature (V2, scratch, prefix caching
cold and warm, chunked prefill) against V1, which is what the matrix cost to run on it (~170 s alone).
"""

import pytest

from gemmaserve import LLM, SamplingParams
from gemmaserve.config.engine import EngineConfig

from helpers import save_checkpoint, tiny_hf_model

CONFIGS = {
    "v1": dict(kv_cache_manager="v1"),
    "v2": dict(kv_cache_manager="v2", swa_scratch_reuse="off", enable_prefix_caching=False),
    "v2+scratch": dict(kv_cache_manager="v2", swa_scratch_reuse="on", enable_prefix_caching=False),
    "v2+scratch+prefix": dict(kv_cache_manager="v2", swa_scratch_reuse="on", enable_prefix_caching=True),
    "v2+prefix": dict(kv_cache_manager="v2", swa_scratch_reuse="off", enable_prefix_caching=True),
}
CHUNKS = [16, 64, 512, None]  # None: the whole prompt in one step


def _outputs(llm, prompts, params, chunk):
    llm.engine._scheduler.max_num_batched_tokens = chunk or 1 << 20
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.engine._kv.check_integrity()


def _check_all(base: LLM, prompts: list[str], params: SamplingParams, model: str, **extra):
    ref = _outputs(LLM.from_config(EngineConfig(model=model, **extra, **CONFIGS["v1"]), base), prompts, params, None)
    for name, opts in CONFIGS.items():
        llm = LLM.from_config(EngineConfig(model=model, **extra, **opts), base)
        for chunk in CHUNKS:
            cold = _outputs(llm, prompts, params, chunk)
            assert cold == ref, f"{name} chunk={chunk} (cold)"
            if opts.get("enable_prefix_caching"):
                hits_before = llm.engine._kv.stats().prefix_hit_tokens
                warm = _outputs(llm, prompts, params, chunk)
                assert warm == ref, f"{name} chunk={chunk} (warm)"
                assert llm.engine._kv.stats().prefix_hit_tokens > hits_before, f"{name} chunk={chunk}: no hit"


def _long_prompts(n_words: int) -> list[str]:
    story = ("The history of the river valley is long. Farmers settled on its banks, built mills and traded "
             "grain with the towns downstream. ")
    words = (story * 80).split()
    return [" ".join(words[:n_words]) + " In short,", " ".join(words[7:7 + n_words // 2]) + " Therefore"]


def test_270m_cache_features_do_not_change_greedy_output(llm_270m):
    prompts = _long_prompts(900)  # ~1100 and ~560 tokens: several 512-token windows
    assert len(llm_270m.tokenizer.encode(prompts[0])) > 2 * 512
    params = SamplingParams(max_tokens=6)
    model = "gemma3-270m"
    ref = _outputs(LLM.from_config(EngineConfig(model=model, **CONFIGS["v1"]), llm_270m), prompts, params, None)
    # Every feature at once, chunked across window boundaries, cold then warm (prefix hits).
    llm = LLM.from_config(EngineConfig(model=model, **CONFIGS["v2+scratch+prefix"]), llm_270m)
    assert _outputs(llm, prompts, params, 64) == ref, "v2+scratch+prefix chunk=64 (cold)"
    hits_before = llm.engine._kv.stats().prefix_hit_tokens
    assert _outputs(llm, prompts, params, 64) == ref, "v2+scratch+prefix chunk=64 (warm)"
    assert llm.engine._kv.stats().prefix_hit_tokens > hits_before, "no prefix hit"
    # V2 alone, whole prompts in one step (no scratch, no prefix cache).
    llm = LLM.from_config(EngineConfig(model=model, **CONFIGS["v2"]), llm_270m)
    assert _outputs(llm, prompts, params, None) == ref, "v2 whole prompt"


@pytest.mark.parametrize("window, seed", [(5, 11), (16, 12)])
def test_tiny_cache_features_do_not_change_greedy_output(tmp_path, window, seed):
    path = save_checkpoint(tiny_hf_model(seed, sliding_window=window, num_key_value_heads=2),
                           tmp_path / "tiny")
    base = LLM(model=str(path))
    prompts = ["abcdefghij klmnop qrstuv " * 8, "zyxw vuts " * 5, "hello world " * 3]
    _check_all(base, prompts, SamplingParams(max_tokens=12, ignore_eos=True), str(path), page_size=4)
