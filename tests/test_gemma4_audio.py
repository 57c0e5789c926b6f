"""Gemma 4's audio tower (models/gemma4_audio.py) against transformers' `Gemma4AudioModel` and its audio embedder,
on tiny random configurations and real speech features (tests/data/speech_16k.wav through our extractor)."""

from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from gemmaserve.models.audio_features import AudioFeatureExtractor
from gemmaserve.models.gemma4_audio import AudioEmbedder, AudioTower, AudioTowerConfig, checkpoint_name

SPEECH = Path(__file__).parent / "data" / "speech_16k.wav"


AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, subsampling_conv_channels=[128, 4],
             output_proj_dims=24)


def _hf_tower(seed: int, clipped: bool):
    from transformers import Gemma4AudioConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel

    from helpers import _gemma4_random

    config = Gemma4AudioConfig(**AUDIO, use_clipped_linears=clipped)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = _gemma4_random(Gemma4AudioModel(config).eval(), seed, 0.5)   # norms and scales around 1
    with torch.no_grad():
        for name, b in model.named_buffers():   # clamps that bite (checkpoints store finite ranges)
            if name.endswith(("_min", "_max")):
                b.fill_(2.0 if name.endswith("_max") else -2.0)
    return model


@pytest.mark.parametrize("samples,clipped", [(25_000, True), (63_650, False), (40_000, True)])
def test_tower_equals_transformers_on_speech_features(samples, clipped):
    """Several attention chunks, padding frames at the end (63,650 samples: the last feature frame is padding),
    clamped and unclamped linears: every real output frame within fp32 rounding, the same output mask."""
    hf = _hf_tower(samples, clipped)
    ours = AudioTower(AudioTowerConfig.from_hf(hf.config.to_dict())).eval()
    ours.load_state_dict({checkpoint_name(k): v for k, v in hf.state_dict().items()}, strict=True)
    speech = soundfile.read(SPEECH, dtype="float32")[0]
    features, mask = AudioFeatureExtractor()(np.resize(speech, samples))
    f, m = torch.from_numpy(features), torch.from_numpy(mask)
    with torch.no_grad():
        want = hf(f[None], attention_mask=m[None])
        got, valid = ours(f, m)
    assert torch.equal(valid, want.attention_mask[0])
    w = want.last_hidden_state[0]
    assert got.shape == w.shape and got.shape[0] > 24   # more frames than one chunk's context
    err = (got[valid] - w[valid]).abs().max().item()
    assert err <= 1e-5 * max(1.0, w.abs().max().item()), err
    if samples == 63_650:
        assert not m.all()


def test_embedder_and_config_checks():
    from transformers import Gemma4AudioConfig, Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

    audio = Gemma4AudioConfig(hidden_size=32, output_proj_dims=24)
    hf = Gemma4MultimodalEmbedder(audio, Gemma4TextConfig(hidden_size=40)).eval()
    with torch.no_grad():
        hf.embedding_projection.weight.normal_()
    ours = AudioEmbedder(AudioTowerConfig.from_hf(audio.to_dict()), 40)
    ours.load_state_dict(hf.state_dict())
    tokens = torch.randn(7, 24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens)).abs().max() <= 1e-6
    with pytest.raises(ValueError, match="activation"):
        AudioTowerConfig.from_hf({"hidden_act": "gelu"})
    with pytest.raises(ValueError, match="future frames"):
        AudioTowerConfig.from_hf({"attention_context_right": 2})


def test_a_checkpoint_with_audio_and_no_vision_loads_and_serves_text(tmp_path):
    """A Gemma4ForConditionalGeneration with an audio tower and no vision tower (E2B-like text): it loads through
    our loader (its audio config checked, the tower's weights left on disk until audio is served), generates
    transformers' greedy tokens, and an image request is a clear error."""
    import transformers

    from gemmaserve import LLM, SamplingParams
    from gemmaserve.errors import UserInputError

    from helpers import GEMMA4_BASE, GEMMA4_VARIANTS, _gemma4_random, write_tokenizer

    cfg = transformers.Gemma4Config(text_config={**GEMMA4_BASE, **GEMMA4_VARIANTS["e2b"]}, vision_config=None,
                                    audio_config=AUDIO)
    cfg._attn_implementation = "eager"
    torch.manual_seed(5)
    hf = _gemma4_random(transformers.Gemma4ForConditionalGeneration(cfg).eval(), 5, 0.5)
    path = tmp_path / "e2b-audio"
    hf.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg.text_config.vocab_size)
    llm = LLM(str(path), dtype="float32")
    model = llm.engine.model
    assert model.image_layout is None and model.mm_config.audio == AudioTowerConfig.from_hf(cfg.audio_config.to_dict())
    assert not any(name.startswith("audio_tower") for name, _ in model.named_parameters())
    ids = [2, 17, 99, 5, 230, 41]
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    engine = llm.engine
    rid = engine.add_request("", SamplingParams(max_tokens=6, ignore_eos=True), prompt_ids=ids)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == rid and o.finished), final)
    assert final.outputs[0].token_ids == hf_tokens
    with pytest.raises(UserInputError, match="does not take images"):
        llm.engine.inputs.load_images([np.zeros((8, 8, 3), dtype=np.uint8)])
