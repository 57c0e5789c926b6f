"""Audio inputs (Gemma 4): containers decoded and resampled by maintained libraries (soundfile, soxr), and the
log-mel features equal to transformers' `Gemma4AudioFeatureExtractor` on real speech (tests/data/speech_16k.wav:
espeak-ng reading a sentence, resampled to 16 kHz)."""

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile

from gemmaserve.engine.media.audio import (AudioLimits, decode_audio_bytes, decode_audio_data_url, decode_input_audio,
                                     load_audio, split_clips)
from gemmaserve.errors import UserInputError
from gemmaserve.models.audio_features import AudioFeatureConfig, AudioFeatureExtractor

SPEECH = Path(__file__).parent / "data" / "speech_16k.wav"
RATE = 16_000


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    samples, rate = soundfile.read(SPEECH, dtype="float32")
    assert rate == RATE and samples.ndim == 1
    return samples


def _encode(samples: np.ndarray, rate: int, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, **kwargs)
    return buf.getvalue()


@pytest.mark.parametrize("length", [None, 12_345, 1_000, 63_650, 64_000])
def test_features_equal_transformers_on_real_speech(speech, length):
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    clip = speech if length is None else np.resize(speech, length)   # lengths off and on the 128-sample grid
    want = Gemma4AudioFeatureExtractor()([clip], return_tensors="np")
    got, mask = AudioFeatureExtractor()(clip)
    assert got.shape == want["input_features"][0].shape and got.dtype == np.float32
    assert np.abs(got - want["input_features"][0]).max() <= 1e-5
    assert (mask == want["input_features_mask"][0]).all()
    if length == 63_650:   # padded to 63,744: the last frame ends on padding
        assert mask[:-1].all() and not mask[-1]


def test_features_of_a_30_s_clip_and_of_a_checkpoints_config(speech):
    """A whole 30 s clip (what the tower takes at once), with a config that normalises per bin and pre-emphasises,
    read from the extractor's own JSON."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    rng = np.random.default_rng(7)
    hf = Gemma4AudioFeatureExtractor(preemphasis=0.97, per_bin_mean=rng.normal(size=128).tolist(),
                                     per_bin_stddev=rng.uniform(0.5, 2, size=128).tolist())
    ours = AudioFeatureExtractor(AudioFeatureConfig.from_hf(json.loads(hf.to_json_string())))
    clip = np.resize(speech, 30 * RATE) + rng.normal(scale=1e-3, size=30 * RATE).astype(np.float32)
    want = hf([clip], return_tensors="np")
    got, mask = ours(clip)
    assert np.abs(got - want["input_features"][0]).max() <= 1e-5 and (mask == want["input_features_mask"][0]).all()
    assert got.shape[0] == ours.num_frames(len(clip))
    with pytest.raises(ValueError, match="longer than"):
        ours(np.zeros(30 * RATE + 1, dtype=np.float32))
    with pytest.raises(ValueError, match="dithering"):
        AudioFeatureConfig.from_hf({"dither": 1e-4})


def test_containers_rates_and_channels_decode_to_the_same_speech(speech):
    """FLAC at 44.1 kHz stereo: the two channels averaged and resampled to 16 kHz; OGG Vorbis and MP3 (lossy):
    the same speech within their coding error; base64 input_audio and data URLs take the same path."""
    import soxr

    limits = AudioLimits()
    at44 = soxr.resample(speech, RATE, 44_100)
    stereo = np.stack([at44, 0.5 * at44], axis=1)
    encoded = _encode(stereo, 44_100, "FLAC")
    got = decode_audio_bytes(encoded, RATE, limits)
    stored = soundfile.read(io.BytesIO(encoded), dtype="float32")[0]   # 16-bit samples
    want = soxr.resample(stored.mean(axis=1, dtype=np.float32), 44_100, RATE, quality="HQ")
    assert got.dtype == np.float32 and np.abs(got - want).max() < 1e-6
    assert abs(len(got) - len(speech)) <= 1 and np.corrcoef(got[:len(speech)], 0.75 * speech[:len(got)])[0, 1] > 0.99
    for fmt in ("OGG", "MP3"):
        lossy = decode_audio_bytes(_encode(speech, RATE, fmt), RATE, limits, fmt=fmt.lower())
        n = min(len(lossy), len(speech))
        lag = int(np.argmax(np.correlate(lossy[:8000], speech[:8000], "full"))) - 7999   # an encoder's delay
        a, b = (lossy[lag:n], speech[:n - lag]) if lag >= 0 else (lossy[:n + lag], speech[-lag:n])
        assert np.corrcoef(a, b)[0, 1] > 0.9, fmt
    wav = SPEECH.read_bytes()
    b64 = base64.b64encode(wav).decode()
    for samples in (decode_input_audio({"data": b64, "format": "wav"}, RATE, limits),
                    decode_audio_data_url("data:audio/wav;base64," + b64, RATE, limits),
                    load_audio(str(SPEECH), RATE, limits), load_audio((speech, RATE), RATE, limits)):
        assert np.array_equal(samples, speech)
    assert [len(c) for c in split_clips(np.zeros(70 * RATE, dtype=np.float32), 480_000)] == [480_000] * 2 + [160_000]
    # cuts in pauses: a 50 ms silence 1 s before each 30 s boundary takes the cut, nothing is lost
    loud = np.random.default_rng(0).normal(0, 0.1, 70 * RATE).astype(np.float32)
    for gap in (29 * RATE, 58 * RATE):
        loud[gap:gap + 800] = 0.0
    clips = split_clips(loud, 480_000, 2 * RATE)
    assert np.array_equal(np.concatenate(clips), loud) and all(len(c) <= 480_000 for c in clips)
    cuts = np.cumsum([len(c) for c in clips])[:-1]
    assert all(gap < cut < gap + 800 for cut, gap in zip(cuts, (29 * RATE, 58 * RATE), strict=True)), cuts


def test_bad_audio_is_a_clear_error(speech, tmp_path):
    limits = AudioLimits(max_bytes=200_000, max_seconds=3.0)
    wav = _encode(speech[:RATE], RATE, "WAV")
    cases = [
        (lambda: decode_audio_bytes(b"RIFF\x00\x00not audio at all" * 10, RATE, limits), "could not be decoded"),
        (lambda: decode_audio_bytes(wav[:30], RATE, limits), "could not be decoded|no samples"),   # header only
        (lambda: decode_audio_bytes(_encode(np.zeros(4 * RATE, dtype=np.float32), RATE, "WAV"), RATE, limits),
         "4.0 s long; the limit is 3 s"),
        (lambda: decode_audio_bytes(b"x" * 200_001, RATE, limits), "200001 bytes; the limit is 200000"),
        (lambda: decode_input_audio({"data": base64.b64encode(wav).decode(), "format": "aiff"}, RATE, limits),
         "format 'aiff' is not one of"),
        (lambda: decode_input_audio({"data": "not base64!", "format": "wav"}, RATE, limits), "invalid base64"),
        (lambda: decode_input_audio({"format": "wav"}, RATE, limits), "needs \"data\""),
        (lambda: decode_audio_data_url("https://example.com/a.wav", RATE, limits), "only data: URLs"),
        (lambda: decode_audio_data_url("data:audio/wav,raw", RATE, limits), "base64-encoded"),
        (lambda: load_audio(np.zeros(10, dtype=np.int16), RATE, limits), "floating point"),
        (lambda: load_audio(np.full(10, np.nan, dtype=np.float32), RATE, limits), "finite"),
        (lambda: load_audio(str(tmp_path / "missing.wav"), RATE, limits), "no such file"),
        (lambda: load_audio(3.5, RATE, limits), "expected samples"),
    ]
    for call, match in cases:
        with pytest.raises(UserInputError, match=match):
            call()
