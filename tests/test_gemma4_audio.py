"""Gemma 4's audio tower (models/gemma4_audio.py) against transformers' `Gemma4AudioModel` and its audio embedder,
on tiny random configurations and real speech features (tests/data/speech_16k.wav through our extractor)."""

from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from gemmaserve.models.audio_features import AudioFeatureExtractor
from gemmaserve.models.gemma4_audio import AudioEmbedder, AudioTower, AudioTowerConfig, checkpoint_name

from helpers import chunked_prompt_logits

SPEECH = Path(__file__).parent / "data" / "speech_16k.wav"


AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, subsampling_conv_channels=[128, 4],
             output_proj_dims=24)


def _hf_tower(seed: int, clipped: bool, **overrides):
    from transformers import Gemma4AudioConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel

    from helpers import _gemma4_random

    config = Gemma4AudioConfig(**{**AUDIO, **overrides}, use_clipped_linears=clipped)
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


@pytest.mark.parametrize("chunk,left", [(5, 13), (20, 9)])
def test_tower_equals_transformers_with_other_attention_chunks(chunk, left):
    """An attention chunk that is neither the window (attention_context_left - 1) nor one more shifts
    transformers' relative positions: distance d reads the encoding of d + (chunk + window) // 2 - window (-4 and
    +6 here), none where that is negative. Ours the same, within fp32 rounding (without the shift: 14% and 8%
    apart)."""
    hf = _hf_tower(chunk, False, attention_chunk_size=chunk, attention_context_left=left)
    cfg = AudioTowerConfig.from_hf(hf.config.to_dict())
    assert cfg.position_shift == {5: -4, 20: 6}[chunk]
    ours = AudioTower(cfg).eval()
    ours.load_state_dict({checkpoint_name(k): v for k, v in hf.state_dict().items()}, strict=True)
    features, mask = AudioFeatureExtractor()(soundfile.read(SPEECH, dtype="float32")[0][:25_000])
    f, m = torch.from_numpy(features), torch.from_numpy(mask)
    with torch.no_grad():
        want = hf(f[None], attention_mask=m[None]).last_hidden_state[0]
        got, valid = ours(f, m)
    err = (got[valid] - want[valid]).abs().max().item()
    assert err <= 1e-5 * max(1.0, want.abs().max().item()), err


def test_transformers_is_an_audio_reference():
    """transformers' conformer under eager attention (the only one it has; the tiny models here ask for it) keeps
    each frame to its causal window: features after a frame's receptive field (two stride-2 convolutions: feature
    frames up to 4j + 3 for frame j) leave its output alone. Before 5.20 it read the float mask as a bool one and
    attended to everything but the window; the audio comparisons with it then fail by ~1 in the logits."""
    import transformers

    hf = _hf_tower(5, clipped=False)
    features = torch.randn(160, 128, generator=torch.Generator().manual_seed(5))
    later = features.clone()
    later[4 * 20 + 4:] += 1.0   # after frame 20's receptive field
    mask = torch.ones(1, 160, dtype=torch.bool)
    with torch.no_grad():
        a, b = (hf(f[None], attention_mask=mask).last_hidden_state[0, :21] for f in (features, later))
    assert torch.allclose(a, b, atol=1e-6, rtol=0), (
        f"transformers {transformers.__version__} lets audio frames attend outside their window (an inverted "
        f"mask, fixed in 5.20): not a reference for the audio tests")


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


# -- served: prompts with audio (and images) through our loader, engine, LLM, CLI and server ------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An E2B-like checkpoint with both towers (saved with save_pretrained, its tokenizer and feature extractor
    config), transformers' model and processor over it, and our LLM loading it by directory."""
    from gemmaserve import LLM

    from helpers import hf_vision_processor, save_gemma4_audio_checkpoint, tiny_hf_gemma4_audio

    hf = tiny_hf_gemma4_audio(77)
    path = save_gemma4_audio_checkpoint(hf, tmp_path_factory.mktemp("e2b_audio"))
    llm = LLM(str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20, max_num_batched_tokens=800)
    return hf, hf_vision_processor(path, "gemma4_audio"), path, llm


@pytest.fixture(scope="module")
def speech():
    return soundfile.read(SPEECH, dtype="float32")[0]


def _image(seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))


# (prompt, images, clips as (first sample, samples) of the speech fixture)
AUDIO_PROMPTS = [("<|audio|> what was said", 0, [(0, 16_000)]),
                 ("first <|audio|> then <|audio|> end", 0, [(4_000, 12_000), (20_000, 25_999)]),
                 ("look <|image|> and hear <|audio|>", 1, [(8_000, 30_000)])]


def _case(speech, k: int):
    prompt, n_images, clips = AUDIO_PROMPTS[k]
    return prompt, [_image(k * 10 + i) for i in range(n_images)], [speech[a:a + n] for a, n in clips]


IMG_ID, AUD_ID = 299, 296


def _hf_inputs(processor, prompt, images, clips) -> dict:
    kw = {"images": images} if images else {}
    ref = processor(text=prompt, audio=clips, return_tensors="pt", **kw)
    types = torch.zeros_like(ref["input_ids"])
    types[ref["input_ids"] == IMG_ID] = 1
    types[ref["input_ids"] == AUD_ID] = 3
    ref["mm_token_type_ids"] = types
    return ref


@pytest.mark.parametrize("k", range(len(AUDIO_PROMPTS)))
def test_audio_prompts_equal_transformers_ids_features_and_logits(served, speech, k):
    """Our expansion of each clip (`<|audio>`, one `<|audio|>` per valid subsampled frame, `<audio|>`) and image
    gives transformers' ids; the features are its processor's; the logits at every prompt position, chunked or
    not (a chunk never splits a clip), are transformers' within fp32 rounding."""
    hf, processor, _, llm = served
    prompt, images, clips = _case(speech, k)
    ids, items = llm.engine.inputs.prepare(prompt, images, clips)
    ref = _hf_inputs(processor, prompt, images, clips)
    assert ids == ref["input_ids"][0].tolist()
    audio = [it for it in items if it.modality.value == "audio"]
    assert [it.length for it in audio] == [int(m[::2][::2].sum()) for m in ref["input_features_mask"].numpy()]
    for it, feats, mask in zip(audio, ref["input_features"].numpy(), ref["input_features_mask"].numpy()):
        t = len(it.extra)
        np.testing.assert_allclose(it.data, feats[:t], atol=1e-5, rtol=0)
        assert np.array_equal(it.extra, mask[:t]) and not mask[t:].any()
    with torch.no_grad():
        want = hf(**ref).logits[0]
    for chunk in (len(ids), max(it.length for it in items) + 3):   # the second: chunks end before clips
        got = chunked_prompt_logits(llm.engine._model, ids, items, chunk)
        err = (got - want).abs().max().item()
        assert err < 2e-4 * max(1.0, want.abs().max().item()), (chunk, err)


def test_greedy_tokens_equal_transformers_through_llm_chat_and_cache_modes(served, speech):
    """Greedy continuations of the audio prompts in one batch equal transformers' generate, alone or batched with
    text, with a chunk budget that defers clips to later steps, and under the other KV manager; chat content
    parts (`input_audio`, `audio_url`, samples) give the same ids as the rendered text."""
    import base64
    import io

    from gemmaserve import LLM, SamplingParams
    from gemmaserve.config.engine import EngineConfig

    hf, processor, path, llm = served
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    cases = [_case(speech, k) for k in range(len(AUDIO_PROMPTS))]
    want = []
    for prompt, images, clips in cases:
        ref = _hf_inputs(processor, prompt, images, clips)
        with torch.no_grad():
            out = hf.generate(**ref, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=[])
        want.append(out[0, ref["input_ids"].shape[1]:].tolist())

    def run(engine_llm, extra=()):
        prompts = [p for p, _, _ in cases] + list(extra)
        outs = engine_llm.generate(prompts, params, images=[i or None for _, i, _ in cases] + [None] * len(extra),
                                   audio=[c for _, _, c in cases] + [None] * len(extra), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert run(llm) == want
    assert run(llm, ["plain text here", "more"])[:3] == want
    for options in (dict(kv_cache_manager="v1"), dict(max_num_batched_tokens=200, max_num_seqs=2)):
        other = LLM.from_config(EngineConfig(model=str(path), page_size=4, kv_cache_memory=16 << 20,
                                             **{"max_num_batched_tokens": 800, **options}), llm)
        assert run(other, ["plain text"])[:3] == want, options
        other.engine._kv.check_integrity()
    # chat parts: a clip as base64 WAV (input_audio) and as a data URL, and samples: the prompt and tokens of the
    # rendered conversation with the same audio
    from gemmaserve.models.chat_template import ChatFormatter, ChatMessage

    first, second = cases[1][2]
    buf = io.BytesIO()
    soundfile.write(buf, first, 16_000, format="WAV", subtype="FLOAT")   # lossless
    b64 = base64.b64encode(buf.getvalue()).decode()
    out = llm.chat([{"role": "user", "content": [
        {"type": "text", "text": "first "}, {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
        {"type": "text", "text": " then "}, {"type": "audio", "audio": second},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64}}]}], params)
    rendered = ChatFormatter(llm.tokenizer).render([ChatMessage("user", "first <|audio|> then <|audio|><|audio|>")])
    same = llm.generate(rendered, params, audio=[first, second, first])[0]
    assert out.prompt_token_ids == same.prompt_token_ids and out.outputs[0].token_ids == same.outputs[0].token_ids
    assert out.prompt_token_ids.count(AUD_ID) == 2 * _tokens(processor, first) + _tokens(processor, second)


def _tokens(processor, clip) -> int:
    return list(processor(text="<|audio|>", audio=[clip])["input_ids"][0]).count(AUD_ID)


def test_long_audio_is_split_into_clips_and_bad_audio_is_a_clear_error(served, speech):
    import dataclasses

    from gemmaserve import SamplingParams
    from gemmaserve.engine.media.audio import AudioLimits
    from gemmaserve.errors import UserInputError

    _, _, _, llm = served
    inputs = llm.engine.inputs
    long = np.resize(speech, 65 * 16_000)   # 65 s: three clips at its one placeholder, cut in pauses
    ids, items = inputs.prepare("hear <|audio|> now", audio=[long])
    lengths = [it.length for it in items]
    assert len(items) == 3 and all(700 <= n <= 750 for n in lengths[:2]) and abs(sum(lengths) - 65 * 25) <= 3
    assert all(ids[it.start - 1] == 294 and ids[it.end] == 295 for it in items)
    assert items[0].key != items[1].key and items[1].end + 2 == items[2].start   # consecutive, in place
    _, tail = inputs.prepare("x", audio=[np.resize(speech, 30 * 16_000 + 40)])   # 2.5 ms past 30 s: cut in a pause
    assert len(tail) == 2 and tail[1].length >= 25
    small = dataclasses.replace(llm.engine._validator, max_num_batched_tokens=100)   # a clip is never split across chunks
    cases = [
        (lambda: small.check(ids, SamplingParams(max_tokens=1), items), r"an input \(audio\) takes 750 tokens"),
        (lambda: inputs.prepare("x", audio=[b"RIFF not audio" * 20]), "could not be decoded"),
        (lambda: inputs.prepare("x", audio=[speech], audio_limits=AudioLimits(max_seconds=1.0)), "s long; the limit"),
        (lambda: inputs.prepare("x", audio=[speech] * 3, audio_limits=AudioLimits(max_clips=2)), "at most 2 per request"),
        (lambda: inputs.prepare("<|audio|> <|audio|>", audio=[speech]), "audio placeholders"),
        (lambda: inputs.prepare("x", audio=[np.zeros(0, dtype=np.float32)]), "no samples"),
        (lambda: inputs.prepare("x", audio=[{"data": "!!", "format": "wav"}]), "invalid base64"),
        (lambda: llm.generate("<|audio|> hi", audio=[speech[:100]]), "too short for one audio token"),
        (lambda: llm.generate("<|audio|> hi", audio=[speech.astype(np.int16)]), "must be floating point"),
    ]
    for fn, match in cases:
        with pytest.raises(UserInputError, match=match):
            fn()


def test_audio_over_30_s_equals_transformers_clip_by_clip(served, speech):
    """Over 30 s transformers' processor keeps the first 30 s (its feature extractor truncates at max_length,
    480,000 samples) and drops the rest; we keep it all, as consecutive clips at the placeholder. transformers
    given those clips as inputs at consecutive placeholders is the reference: 38 s of speech and pauses (cut in the
    last pause before 30 s: clips of 750 and 200 tokens) gives its ids, its features and soft tokens for each
    clip, and its logits at every position within fp32 rounding (in the engine's chunks of 800), and the engine's
    first greedy token is its argmax. Exactly 30 s is one clip of 750 tokens, transformers' ids and features."""
    from gemmaserve import SamplingParams
    from gemmaserve.engine.media.audio import split_clips
    from gemmaserve.models.multimodal import Modality

    hf, processor, _, llm = served
    rate, limit = 16_000, 480_000
    period = np.concatenate([speech, np.zeros(5 * rate - len(speech), dtype=np.float32)])   # speech, silence to 5 s
    long = np.resize(period, 38 * rate)
    prompt = "hear <|audio|> now"
    ids, items = llm.engine.inputs.prepare(prompt, audio=[long])
    clips = split_clips(long, limit, 2 * rate)   # the engine's cuts
    assert np.array_equal(np.concatenate(clips), long) and [it.length for it in items] == [750, 200]

    ref = _hf_inputs(processor, prompt.replace("<|audio|>", "<|audio|>" * len(clips)), [], clips)
    assert ids == ref["input_ids"][0].tolist()
    for it, feats, mask in zip(items, ref["input_features"].numpy(), ref["input_features_mask"].numpy()):
        t = len(it.extra)
        np.testing.assert_allclose(it.data, feats[:t], atol=1e-5, rtol=0)
        assert np.array_equal(it.extra, mask[:t]) and not mask[t:].any()
    with torch.no_grad():
        out = hf(**ref)
    model = llm.engine._model
    with torch.inference_mode():
        soft = [model.encode_media(Modality.AUDIO, [it.data], [it.extra], torch.device("cpu"))[0] for it in items]
    for ours, theirs, valid in zip(soft, out.audio_outputs.pooler_output, out.audio_outputs.attention_mask):
        want = theirs[valid]
        assert ours.shape == want.shape and (ours - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
    want = out.logits[0]
    got = chunked_prompt_logits(model, ids, items, 800, soft)
    err = (got - want).abs().max().item()
    assert err < 2e-4 * max(1.0, want.abs().max().item()), err
    first = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), audio=[long])[0]
    assert first.prompt_token_ids == ids and first.outputs[0].token_ids == [int(want[-1].argmax())]

    # exactly 30 s: one clip; transformers' whole input over 30 s: the same 30 s, the rest dropped
    exact = long[:limit]
    ids30, items30 = llm.engine.inputs.prepare("<|audio|>", audio=[exact])
    ref30 = processor(text="<|audio|>", audio=[exact], return_tensors="np")
    assert [it.length for it in items30] == [750] and ids30 == ref30["input_ids"][0].tolist()
    np.testing.assert_allclose(items30[0].data, ref30["input_features"][0], atol=1e-5, rtol=0)
    truncated = processor(text="<|audio|>", audio=[long], return_tensors="np")
    assert truncated["input_ids"][0].tolist() == ids30
    assert np.array_equal(truncated["input_features"], ref30["input_features"])


def test_audio_to_a_model_without_an_audio_tower_is_a_clear_error(tmp_path):
    """A Gemma 4 checkpoint with no audio tower (vision only) and the embedded text model both refuse audio by
    name, from the Python API and in chat parts."""
    from gemmaserve import LLM
    from gemmaserve.errors import UserInputError

    from helpers import save_gemma4_vision_checkpoint, tiny_hf_gemma4_vision

    path = save_gemma4_vision_checkpoint(tiny_hf_gemma4_vision(3, "e2b"), tmp_path / "vision_only")
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    with pytest.raises(UserInputError, match="does not take audio"):
        llm.generate("hi", audio=[np.zeros(16_000, dtype=np.float32)])
    with pytest.raises(UserInputError, match="does not take audio"):
        llm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}])


def _wav(samples, rate: int = 16_000, fmt: str = "WAV") -> bytes:
    import io

    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, **({"subtype": "FLOAT"} if fmt == "WAV" else {}))
    return buf.getvalue()


def test_server_chat_audio_and_transcriptions_through_the_openai_client(served, speech):
    """Through the official client: a chat with `input_audio` gives LLM.chat's greedy text; transcriptions and
    translations give the text of the same instruction run through LLM.chat, in every response format and
    streamed; a 75 s upload is cut into three clips (three segments and cues, in order); bad uploads are clear
    400/413s and the server keeps serving."""
    import base64

    openai = pytest.importorskip("openai")
    from gemmaserve import SamplingParams
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm_engine import LLMEngine
    from gemmaserve.server.background import BackgroundServer
    from gemmaserve.server.config import ServerConfig
    from gemmaserve.server.serving_audio import _instruction

    _, _, path, llm = served
    clip = speech[:24_000]
    wav = _wav(clip)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20,
                                    max_num_batched_tokens=800, cpu_compile="off"), llm.engine._loaded)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    chat = [{"type": "text", "text": "listen"},
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}]
    want_chat = llm.chat([{"role": "user", "content": chat}], greedy).outputs[0].text

    def reference(samples, translate=False, language=None) -> str:
        params = SamplingParams(max_tokens=5, temperature=0)
        content = [{"type": "audio", "audio": samples}, {"type": "text", "text": _instruction(translate, language, None)}]
        return " ".join(llm.chat([{"role": "user", "content": content}], params).outputs[0].text.split())

    with BackgroundServer(engine, ServerConfig(max_audio_bytes=2 << 20, max_audio_per_request=2)) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        got = client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": chat}],
                                             max_tokens=6, temperature=0)
        assert got.choices[0].message.content == want_chat
        assert got.usage.prompt_tokens == len(llm.chat([{"role": "user", "content": chat}], greedy).prompt_token_ids)

        extra = {"max_tokens": 5}
        text = client.audio.transcriptions.create(model=str(path), file=("a.wav", wav), language="de",
                                                  extra_body=extra)
        assert text.text == reference(clip, language="German")
        plain = client.audio.transcriptions.create(model=str(path), file=("a.wav", wav), language="de",
                                                   response_format="text", extra_body=extra)
        assert plain.strip() == text.text
        trans = client.audio.translations.create(model=str(path), file=("a.flac", _wav(clip, fmt="FLAC")),
                                                 extra_body=extra)
        assert trans.text == reference(clip, translate=True)
        events = list(client.audio.transcriptions.create(model=str(path), file=("a.wav", wav), language="de",
                                                         stream=True, extra_body=extra))
        assert events[-1].type == "transcript.text.done" and events[-1].text == text.text
        assert "".join(e.delta for e in events[:-1]) == text.text
        # past its deadline mid-stream: an error event, not a broken connection
        with pytest.raises(openai.APIError, match="deadline|timed out|time"):
            list(client.audio.transcriptions.create(model=str(path), file=("a.wav", wav), stream=True,
                                                    extra_body={**extra, "request_timeout": 1e-6}))

        # 75 s: three clips, each a segment and a cue, in time order
        long = np.resize(speech, 75 * 16_000)
        up = ("long.wav", _wav(long, fmt="FLAC"))
        verbose = client.audio.transcriptions.create(model=str(path), file=up, response_format="verbose_json",
                                                     extra_body=extra)
        segs = verbose.segments
        assert len(segs) == 3 and segs[0].start == 0 and abs(segs[-1].end - 75) < 1e-3 and verbose.duration == 75
        assert all(a.end == b.start and 28 <= a.end - a.start <= 30 for a, b in zip(segs, segs[1:]))
        assert verbose.text == " ".join(s.text for s in segs if s.text)
        srt = client.audio.transcriptions.create(model=str(path), file=up, response_format="srt", extra_body=extra)
        vtt = client.audio.transcriptions.create(model=str(path), file=up, response_format="vtt", extra_body=extra)
        cues = [s for s in segs if s.text]
        assert srt.startswith("1\n00:00:00,000 --> ") and srt.count(" --> ") == len(cues)
        assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ") and vtt.count(" --> ") == len(cues)

        bad = [(("a.wav", b"RIFF....WAVEfmt broken"), {}, openai.BadRequestError, "could not be decoded"),
               (("a.txt", b"just some text, not audio at all" * 4), {}, openai.BadRequestError, "could not be decoded"),
               (("a.wav", wav), {"language": "xx"}, openai.BadRequestError, "ISO-639-1"),
               (("a.wav", wav[:60]), {}, openai.BadRequestError, "could not be decoded|no samples|too short"),
               (("big.wav", _wav(np.resize(speech, 40 * 16_000))), {}, openai.APIStatusError, "limit"),
               (("a.wav", wav), {"response_format": "srt", "stream": True}, openai.BadRequestError, "stream")]
        for upload, kw, error, words in bad:
            with pytest.raises(error, match=words) as info:
                client.audio.transcriptions.create(model=str(path), file=upload, **kw)
            if upload[0] == "big.wav":
                assert info.value.status_code == 413
        bad_chat = [({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "data: URLs"),
                    ({"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}, "base64"),
                    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(),
                                                             "format": "aiff"}}, "format 'aiff'")]
        for part, words in bad_chat:
            with pytest.raises(openai.BadRequestError, match=words):
                client.chat.completions.create(model=str(path), max_tokens=2,
                                               messages=[{"role": "user", "content": [part]}])
        with pytest.raises(openai.BadRequestError, match="at most 2"):
            client.chat.completions.create(model=str(path), max_tokens=2,
                                           messages=[{"role": "user", "content": [chat[1]] * 3}])
        again = client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": chat}],
                                               max_tokens=6, temperature=0)
        assert again.choices[0].message.content == want_chat

        # a model that thinks before it transcribes: the transcript is the answer alone
        from helpers import CHANNEL_BEGIN, CHANNEL_END, scripted_logits

        tok = llm.tokenizer
        scripted_logits(engine._model, [CHANNEL_BEGIN, *tok.encode("thought\nhmm", add_special_tokens=False),
                                       CHANNEL_END, *tok.encode("hello there", add_special_tokens=False)])
        try:
            said = client.audio.transcriptions.create(model=str(path), file=("a.wav", wav), extra_body={"max_tokens": 40})
        finally:
            del engine._model.compute_logits
        assert said.text.startswith("hello there") and "hmm" not in said.text and "thought" not in said.text
        srv.server.async_engine.call_blocking(lambda e: e.check_integrity())


def test_cli_audio_flag(served, speech, tmp_path, capsys):
    import json

    from gemmaserve import SamplingParams
    from gemmaserve.cli import main

    _, _, path, llm = served
    (tmp_path / "speech.ogg").write_bytes(_wav(speech[:20_000], fmt="OGG"))
    argv = ["generate", "--model", str(path), "--dtype", "float32", "--page-size", "4", "--kv-cache-memory", "16MiB",
            "--json", "--max-tokens", "4", "--ignore-eos", "--audio", str(tmp_path / "speech.ogg"), "hear <|audio|>"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = llm.generate("hear <|audio|>", SamplingParams(max_tokens=4, ignore_eos=True),
                        audio=[str(tmp_path / "speech.ogg")])[0]
    assert got["token_ids"] == want.outputs[0].token_ids
    assert main(argv[:-2] + [str(tmp_path / "missing.wav"), "x"]) != 0
    assert "no such file" in capsys.readouterr().err


def test_drafts_leave_audio_and_video_requests_unchanged(served, speech, tmp_path):
    """An MTP drafter (it reads the text tower's KV and embeddings) and prompt lookup over prompts with audio clips
    and a video: the same greedy tokens as without drafts, drafts made and the KV pool whole."""
    from gemmaserve import LLM, SamplingParams
    from gemmaserve.config.engine import EngineConfig

    from helpers import tiny_gemma4_assistant

    _, _, path, llm = served
    frames = np.random.default_rng(4).integers(0, 256, (5, 30, 40, 3), dtype=np.uint8)
    prompts = ["hear <|audio|> and <|audio|> again", "watch <|video|> now", "only text here"]
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(engine_llm):
        outs = engine_llm.generate(prompts, params, audio=[[speech[:16_000], speech[8_000:30_000]], None, None],
                                   videos=[None, [(frames, 4)], None], use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    want = run(llm)
    tiny_gemma4_assistant(99, "e2b").save_pretrained(tmp_path / "drafter")
    for spec in ({"method": "mtp", "model": str(tmp_path / "drafter"), "num_speculative_tokens": 3},
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        other = LLM.from_config(EngineConfig(model=str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20,
                                             max_num_batched_tokens=800, cpu_compile="off",
                                             speculative_config={**spec, "disable_by_batch_size": 64}), llm)
        assert run(other) == want, spec["method"]
        assert other.engine._scheduler.spec_stats.drafted > 0, spec["method"]
        other.engine._kv.check_integrity()


def test_tensor_parallel_ranks_and_preemption_keep_media_tokens(served, speech):
    """Requests with audio clips, a video and an image, beside a text one: two tensor-parallel ranks (each runs
    the replicated towers on its step's items), and a pool so small that they are preempted and resumed (their
    items read back from the encoder cache or encoded again) give one roomy process's greedy tokens and counts;
    once all finish the encoder cache holds nothing for them and the pool is whole."""
    from gemmaserve import LLM, SamplingParams
    from gemmaserve.config.engine import EngineConfig

    _, _, path, llm = served
    frames = np.random.default_rng(5).integers(0, 256, (3, 30, 40, 3), dtype=np.uint8)
    prompts = ["hear <|audio|> and <|audio|> again", "watch <|video|> now", "look <|image|> here", "only text here"]
    media = dict(audio=[[speech[:12_000], speech[8_000:20_000]], None, None, None],
                 videos=[None, [(frames, 2)], None, None], images=[None, None, [_image(3)], None])
    params = SamplingParams(max_tokens=48, ignore_eos=True)

    def run(engine_llm):
        outs = engine_llm.generate(prompts, params, use_tqdm=False, **media)
        assert all(o.outputs[0].finish_reason == "length" for o in outs), [o.outputs[0].error for o in outs]
        return [(o.prompt_token_ids, o.outputs[0].token_ids, o.num_cached_tokens) for o in outs]

    # a fresh engine (the module's one has these prompts' prefixes cached from other tests)
    want = run(LLM.from_config(EngineConfig(model=str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20,
                                            max_num_batched_tokens=800), llm))
    two = LLM(str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20, max_num_batched_tokens=800,
              tensor_parallel_size=2)
    try:
        assert run(two) == want
    finally:
        two.engine.shutdown()
    kv = llm.engine._kv
    longest = max(len(ids) for ids, _, _ in want) + params.max_tokens
    # 80-token chunks (the frames' and the image's 70 fit; the clips are shorter): decodes growing together preempt
    tight = LLM.from_config(EngineConfig(model=str(path), dtype="float32", page_size=4, max_num_batched_tokens=80,
                                         kv_cache_memory=int(1.2 * kv.peak_pages(longest, 80)) * kv.page_bytes), llm)
    assert run(tight) == want
    assert tight.engine._scheduler.num_preemptions > 0
    assert not tight.engine._runner.media.cache._held and not tight.engine._runner.media
    tight.engine._kv.check_integrity()
