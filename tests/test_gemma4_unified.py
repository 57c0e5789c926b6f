"""The 12B `gemma4_unified` with images, audio and video against transformers' Gemma4UnifiedForConditionalGeneration
on tiny random checkpoints saved with save_pretrained: preprocessing against transformers' own functions (its
image processor module needs torchvision to import, so its merge, patch and size functions are run from their
source; the resize is torch's antialiased bicubic, which torchvision calls), audio frames against its feature
extractor, logits at every prompt position and greedy tokens against its model. Images are causal unless
use_bidirectional_attention="vision" (the 12B's setting): then an image sees itself on sliding layers within the
window (the reference rule, gemma-architecture.md §5.5)."""

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gemmaserve import LLM, SamplingParams

from helpers import (AUD, BOA, BOI, EOA, EOI, GEMMA4_BASE, GEMMA4_VARIANTS, IMG, VID, _gemma4_random,
                     add_special_tokens, chunked_prompt_logits, save_vision_checkpoint, GEMMA4_IMAGE_SPECIALS,
                     GEMMA4_AUDIO_SPECIALS)

VISION = dict(patch_size=4, pooling_kernel_size=3, mm_embed_dim=32, mm_posemb_size=64, output_proj_dims=32)
SOFT = 70


def _transformers_functions() -> dict:
    """get_aspect_ratio_preserving_size, convert_image_to_patches, patches_merge and pad_along_first_dim from
    transformers' unified image processor source (the module imports torchvision, which this machine lacks)."""
    import transformers

    path = Path(transformers.__file__).parent / "models" / "gemma4_unified" / "image_processing_gemma4_unified.py"
    tree = ast.parse(path.read_text())
    wanted = {"get_aspect_ratio_preserving_size", "convert_image_to_patches", "patches_merge", "pad_along_first_dim"}
    module = ast.Module(body=[n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted],
                        type_ignores=[])
    scope = {"torch": torch, "math": math}
    exec(compile(module, str(path), "exec"), scope)
    assert wanted <= set(scope)
    return scope


def _checkpoint(path: Path, bidirectional: str | None):
    import transformers

    text = {**GEMMA4_BASE, **GEMMA4_VARIANTS["12b_unified"], "use_bidirectional_attention": bidirectional}
    text.pop("unified")
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        text.pop(key)
    cfg = transformers.Gemma4UnifiedConfig(text_config=text, vision_config=VISION, audio_config={},
                                           image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI, audio_token_id=AUD,
                                           boa_token_id=BOA, eoa_token_index=EOA, video_token_id=VID)
    cfg._attn_implementation = "eager"
    torch.manual_seed(21)
    hf = _gemma4_random(transformers.Gemma4UnifiedForConditionalGeneration(cfg).eval(), 21, 0.5)
    save_vision_checkpoint(hf, path, GEMMA4_IMAGE_SPECIALS)
    add_special_tokens(path, {**dict(zip((BOA, EOA, AUD), GEMMA4_AUDIO_SPECIALS)), VID: "<|video|>"})
    (path / "preprocessor_config.json").write_text(
        '{"image_processor_type": "Gemma4UnifiedImageProcessor", "max_soft_tokens": %d}' % SOFT)
    llm = LLM(str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20, max_num_batched_tokens=800,
              cpu_compile="off")
    return hf, path, llm


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Causal images (use_bidirectional_attention unset): everything served."""
    return _checkpoint(tmp_path_factory.mktemp("unified"), None)


def _image(seed: int, size=(37, 53)):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (*size, 3), dtype=np.uint8)


def test_patches_equal_transformers_functions(setup):
    _, _, llm = setup
    fns = _transformers_functions()
    from gemmaserve.models.gemma4_vision import resize_like_torchvision
    from gemmaserve.models.multimodal import Modality

    proc = llm.engine.inputs.layouts[Modality.IMAGE].processor
    for seed, size in ((1, (37, 53)), (2, (120, 30)), (3, (12, 12)), (4, (200, 180))):
        rgb = _image(seed, size)
        got = proc(rgb)
        th, tw = fns["get_aspect_ratio_preserving_size"](height=size[0], width=size[1], patch_size=4,
                                                          max_patches=SOFT * 9, pooling_kernel_size=3)
        image = torch.from_numpy(resize_like_torchvision(rgb, th, tw)).permute(2, 0, 1) * (1 / 255)
        teacher = fns["convert_image_to_patches"](image, 4)
        pw, ph = tw // 4, th // 4
        grid = torch.stack(torch.meshgrid(torch.arange(pw), torch.arange(ph), indexing="xy"), -1).reshape(-1, 2)
        merged, positions = fns["patches_merge"](teacher[None], grid[None], teacher.shape[0] // 9)
        merged, positions = fns["pad_along_first_dim"](merged[0], positions[0], SOFT)
        assert got.num_tokens == teacher.shape[0] // 9
        np.testing.assert_array_equal(got.data, merged.numpy())
        np.testing.assert_array_equal(got.extra, positions.numpy())


def _hf_inputs(ids, items, features=None):
    ids_t = torch.tensor([ids])
    types = torch.zeros_like(ids_t)
    types[ids_t == IMG], types[ids_t == AUD] = 1, 3
    out = {"input_ids": ids_t, "mm_token_type_ids": types, "attention_mask": torch.ones_like(ids_t)}
    images = [it for it in items if it.modality.value == "image"]
    if images:
        out["pixel_values"] = torch.from_numpy(np.stack([it.data for it in images]))
        out["image_position_ids"] = torch.from_numpy(np.stack([it.extra for it in images]))
    if features is not None:
        out["input_features"], out["input_features_mask"] = features
    return out


def test_logits_and_greedy_tokens_equal_transformers(setup):
    """Causal images and audio clips in one prompt: the audio frames equal transformers'
    feature extractor's, the layout its processor's, and the logits at every position (in one chunk and in chunks
    that stop before items) and the greedy tokens its model's."""
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import Gemma4UnifiedAudioFeatureExtractor

    hf, _, llm = setup
    rng = np.random.default_rng(8)
    clips = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in (3000, 5200)]
    images = [_image(5), _image(6, (90, 64))]
    prompt = "look <|image|> hear <|audio|> and <|image|> then <|audio|> end"
    ids, items = llm.engine.inputs.prepare(prompt, images=images, audio=clips)
    ref = Gemma4UnifiedAudioFeatureExtractor()(clips, return_tensors="pt")
    audio = [it for it in items if it.modality.value == "audio"]
    assert [it.length for it in audio] == [math.ceil(n / 640) for n in (3000, 5200)]
    for it, f in zip(audio, ref["input_features"]):
        np.testing.assert_array_equal(it.data, f[:it.length].numpy())
    text = llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.count("<|image>") == 2 and text.count("<|audio>") == 2
    inputs = _hf_inputs(ids, items, (ref["input_features"], ref["input_features_mask"]))
    with torch.no_grad():
        want = hf(**inputs).logits[0]
    for chunk in (len(ids), max(it.length for it in items) + 3):
        got = chunked_prompt_logits(llm.engine._model, ids, items, chunk)
        err = (got - want).abs().max().item()
        assert err < 2e-4 * max(1.0, want.abs().max().item()), (chunk, err)
    with torch.no_grad():
        ref_tokens = hf.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                 eos_token_id=[])[0, len(ids):].tolist()
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = llm.generate([prompt, "only text"], params, images=[images, None], audio=[clips, None], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref_tokens
    llm.engine._kv.check_integrity()


def _reference_masks(hf, inputs) -> dict:
    """transformers' masks for the reference rule (its `create_masks_for_generate`: full layers causal, sliding
    layers window AND (causal OR same image)), which its forward takes as a dict."""
    ids = inputs["input_ids"]
    embeds = torch.zeros(*ids.shape, hf.config.get_text_config().hidden_size)
    return hf.create_masks_for_generate(hf.config, embeds, inputs["attention_mask"], None,
                                        torch.arange(ids.shape[1])[None], inputs["mm_token_type_ids"])


def _reference_greedy(hf, inputs: dict, n: int) -> list[int]:
    """n greedy tokens, each a whole forward under the reference masks (generated tokens are text)."""
    inputs, out = dict(inputs), []
    for _ in range(n):
        with torch.no_grad():
            tok = int(hf(**{**inputs, "attention_mask": _reference_masks(hf, inputs)}).logits[0, -1].argmax())
        out.append(tok)
        inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[tok]])], 1)
        inputs["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, 1))
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    return out


def test_the_12b_vision_mask_is_the_reference_rule(tmp_path):
    """use_bidirectional_attention="vision" (the 12B's setting) with images longer than the sliding window: an
    image sees itself on sliding layers within the window, full layers stay causal. Logits at every position
    (whole and chunked) and greedy tokens equal transformers' under that rule's masks; they differ from its
    `forward`'s own (the image OR'ed into both masks, gemma-architecture.md §5.5), so the rule is what is tested."""
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import Gemma4UnifiedAudioFeatureExtractor

    hf, _, llm = _checkpoint(tmp_path, "vision")
    images = [_image(5), _image(6, (90, 64))]
    clip = (0.1 * np.random.default_rng(3).standard_normal(4000)).astype(np.float32)
    prompt = "look <|image|> hear <|audio|> and <|image|> end"
    ids, items = llm.engine.inputs.prepare(prompt, images=images, audio=[clip])
    window = hf.config.get_text_config().sliding_window
    assert all(it.length > window for it in items if it.modality.value == "image")
    ref = Gemma4UnifiedAudioFeatureExtractor()([clip], return_tensors="pt")
    inputs = _hf_inputs(ids, items, (ref["input_features"], ref["input_features_mask"]))
    with torch.no_grad():
        want = hf(**{**inputs, "attention_mask": _reference_masks(hf, inputs)}).logits[0]
        forward_rule = hf(**inputs).logits[0]
    scale = max(1.0, want.abs().max().item())
    assert (forward_rule - want).abs().max().item() > 1e-2 * scale
    for chunk in (len(ids), max(it.length for it in items) + 3):
        got = chunked_prompt_logits(llm.engine._model, ids, items, chunk)
        assert (got - want).abs().max().item() < 2e-4 * scale, chunk
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = llm.generate([prompt, "only text"], params, images=[images, None], audio=[[clip], None], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == _reference_greedy(hf, inputs, 5)
    llm.engine._kv.check_integrity()


def test_video_frames_and_bad_input(setup):
    """A video's frames as images at the video budget, stamped; a float image is refused."""
    from gemmaserve.errors import UserInputError

    hf, _, llm = setup
    frames = np.stack([_image(10 + i, (40, 40)) for i in range(3)])
    ids, items = llm.engine.inputs.prepare("see <|video|>", videos=[(frames, 2)])
    assert len(items) == 3 and all(it.modality.value == "video" and it.bidirectional for it in items)
    assert llm.tokenizer.decode(ids, skip_special_tokens=False).count("00:0") == 3
    out = llm.generate("see <|video|>", SamplingParams(max_tokens=3, ignore_eos=True), videos=[(frames, 2)])
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(UserInputError, match="uint8"):
        llm.engine.inputs.prepare("x", images=[np.zeros((4, 4, 3), dtype=np.float32)])
