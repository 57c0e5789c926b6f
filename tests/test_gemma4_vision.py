"""Gemma 4 with images against transformers' Gemma4ForConditionalGeneration on tiny random checkpoints:
31B-like (bidirectional image attention on sliding layers, standardised features, K = V) and E2B-like
(per-layer embeddings, KV sharing, clipped encoder linears, causal images)."""

import numpy as np
import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.config.engine import EngineConfig

from helpers import (IMG, GEMMA4_VISION_VARIANTS as VARIANTS, assert_image_prompt_matches, chunked_prompt_logits,
                     hf_vision_processor, save_gemma4_vision_checkpoint as _save, tiny_gemma4_assistant,
                     tiny_hf_gemma4_vision)

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def setup(request, tmp_path_factory):
    hf = tiny_hf_gemma4_vision(4321, request.param)
    path = _save(hf, tmp_path_factory.mktemp(f"g4v_{request.param}"))
    llm = LLM(model=str(path), page_size=4, max_num_batched_tokens=256, kv_cache_memory=8 << 20)
    return request.param, hf, path, llm


@pytest.fixture(scope="module")
def processor(setup):
    """transformers' Gemma4Processor (images only) over the checkpoint's tokenizer: the reference prompt ids."""
    return hf_vision_processor(setup[2], "gemma4")


def _images(n: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(40, 30), (13, 50), (24, 24), (70, 20)]
    return [Image.fromarray(rng.integers(0, 256, (sizes[i % 4][1], sizes[i % 4][0], 3), dtype=np.uint8))
            for i in range(n)]


def test_preprocessing_equals_hf_processor():
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from gemmaserve.models.gemma4_vision import Gemma4ImageProcessor

    images = _images(4, 3)
    for soft in (70, 280):
        ref = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=soft, pooling_kernel_size=3)(images,
                                                                                                  return_tensors="np")
        got = [Gemma4ImageProcessor(4, 3, soft)(im) for im in images]
        assert [g.num_tokens for g in got] == list(ref["num_soft_tokens_per_image"])
        np.testing.assert_array_equal(np.stack([g.extra for g in got]), ref["image_position_ids"])
        np.testing.assert_array_equal(np.stack([g.data for g in got]), ref["pixel_values"])   # bit for bit


def _inputs(llm, prompt, images):
    ids, items = llm.engine.inputs.prepare_images(prompt, images)
    pixels = torch.from_numpy(np.stack([it.data for it in items]))
    positions = torch.from_numpy(np.stack([it.extra for it in items]))
    return ids, items, pixels, positions


def _hf_inputs(processor, prompt, images):
    """transformers' own ids, patches and patch positions for the prompt (its placeholder expansion)."""
    ref = processor(text=prompt, images=images, return_tensors="pt")
    return ref["input_ids"][0].tolist(), ref["pixel_values"], ref["image_position_ids"]


def _hf_logits(hf, ids, pixels, positions):
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        return hf(input_ids=ids_t, pixel_values=pixels, image_position_ids=positions,
                  mm_token_type_ids=(ids_t == IMG).long()).logits[0]


PROMPTS = [("<|image|> describe it", 1), ("two <|image|> and <|image|> end", 2), ("look at <|image|>", 1)]


@pytest.mark.parametrize("prompt, n", PROMPTS + [
    ("<|image|><|image|>", 2), ("line one\n<|image|>\nline two", 1), ("x <|image|> y <|image|> z <|image|> w <|image|>", 4)])
def test_prompt_ids_equal_transformers_processor(setup, processor, prompt, n):
    """Our placeholder expansion is transformers': "<|image>", as many "<|image|>" soft tokens as the
    image's size gives, "<image|>" (no separators), in the same ids, the images' spans where its token
    types say, and the same patches and positions."""
    llm = setup[3]
    images = _images(n, 5)
    ids, items = llm.engine.inputs.prepare_images(prompt, images)
    ref = processor(text=prompt, images=images, return_tensors="np")
    assert_image_prompt_matches(ids, items, ref, "mm_token_type_ids")
    np.testing.assert_array_equal(np.stack([it.extra for it in items]), ref["image_position_ids"])


@pytest.mark.parametrize("chunk", [70, 100, 256])
def test_logits_match_transformers(setup, processor, chunk):
    import copy

    name, hf, _, llm = setup
    hf64 = copy.deepcopy(hf).double()
    for k, (prompt, n) in enumerate(PROMPTS):
        ids, items, _, _ = _inputs(llm, prompt, _images(n, k))
        hf_ids, pixels, positions = _hf_inputs(processor, prompt, _images(n, k))
        assert ids == hf_ids
        ref = _hf_logits(hf, ids, pixels, positions)
        got = chunked_prompt_logits(llm.engine._model, ids, items, chunk)
        # The tiny random E2B stack amplifies fp32 rounding: transformers' own fp32 logits are up to
        # ~1.5e-4 off its fp64 ones here. Where that is so, we must be as close as it is.
        exact = _hf_logits(hf64, ids, pixels.double(), positions).float()
        noise = (ref - exact).abs().max().item()
        err = (got - ref).abs().max().item()
        assert err < max(TOL, 2 * noise), f"{name} {prompt!r} chunk={chunk}: {err} (transformers fp32 noise {noise})"


PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def _run(llm, extra_text=()):
    prompts = [p for p, _ in PROMPTS] + list(extra_text)
    images = [_images(n, k) for k, (_, n) in enumerate(PROMPTS)] + [None] * len(extra_text)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False, images=images)]


def test_greedy_equals_transformers_and_cache_modes(setup, processor):
    name, hf, path, llm = setup
    got = _run(llm)
    for k, ((prompt, n), tokens) in enumerate(zip(PROMPTS, got)):
        ids, pixels, positions = _hf_inputs(processor, prompt, _images(n, k))
        ids_t = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(input_ids=ids_t, pixel_values=pixels, image_position_ids=positions,
                              mm_token_type_ids=(ids_t == IMG).long(), attention_mask=torch.ones_like(ids_t),
                              max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=[])
        assert tokens == out[0, len(ids):].tolist(), (name, prompt)
    expected = _run(llm, ["plain text", "more"])
    for options in (dict(kv_cache_manager="v1"), dict(max_num_batched_tokens=80, max_num_seqs=2)):
        other = LLM.from_config(EngineConfig(model=str(path), page_size=4, kv_cache_memory=8 << 20,
                                             **{"max_num_batched_tokens": 256, **options}), llm)
        for _ in range(2):
            assert _run(other, ["plain text", "more"]) == expected, options
        other.engine._kv.check_integrity()


def test_mtp_drafts_leave_image_requests_unchanged(setup, tmp_path):
    """A Gemma 4 MTP drafter over prompts with images (the drafter reads the text tower's KV and embedding):
    the same tokens as without drafts."""
    name, _, path, llm = setup
    tiny_gemma4_assistant(99, name).save_pretrained(tmp_path / "drafter")
    expected = _run(llm, extra_text=["just text here"])
    spec = {"method": "mtp", "model": str(tmp_path / "drafter"), "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}
    other = LLM.from_config(EngineConfig(model=str(path), page_size=4, kv_cache_memory=8 << 20,
                                         max_num_batched_tokens=96, speculative_config=spec), llm)
    assert _run(other, extra_text=["just text here"]) == expected
    assert other.engine._scheduler.spec_stats.drafted > 0
    other.engine._kv.check_integrity()
