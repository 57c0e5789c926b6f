"""Audio of a request: from what users pass (encoded bytes, base64 `input_audio`, data URLs, numpy samples, file
paths in the Python API) to mono float32 samples at the model's rate, within the request's limits.

    bytes  -> soundfile (libsndfile: WAV, FLAC, OGG Vorbis/Opus, MP3, ...) -> [frames, channels]
           -> channels averaged -> soxr to `rate` (high quality) -> [N] float32
    long   -> clips of at most what the encoder takes at once (30 s), consecutive, in order

Decoding and resampling are maintained libraries', never ours; what a file holds that they cannot read is a
UserInputError naming the input, as is anything over the limits (the server turns these into 400s).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import UserInputError
from .images import base64_bytes, data_url_bytes

# `input_audio.format` values and the containers soundfile reads them as (None: let it detect)
FORMATS = {"wav": "WAV", "flac": "FLAC", "ogg": "OGG", "mp3": "MP3"}


@dataclass(frozen=True)
class AudioLimits:
    """Per request; the server's defaults protect it from oversized uploads."""

    max_clips: int = 8                   # audio inputs per request (each may be split into several clips)
    max_bytes: int = 25 * 2**20          # of one encoded clip (OpenAI's upload limit for transcriptions)
    max_seconds: float = 300.0           # of one input (split into the encoder's clips)


def decode_audio_bytes(data: bytes, rate: int, limits: AudioLimits, fmt: str | None = None,
                       what: str = "audio") -> np.ndarray:
    """Encoded audio -> mono float32 samples at `rate`, or a UserInputError naming why not."""
    import soundfile

    if len(data) > limits.max_bytes:
        raise UserInputError(f"{what} is {len(data)} bytes; the limit is {limits.max_bytes}")
    if fmt is not None and fmt.lower() not in FORMATS:
        raise UserInputError(f"{what}: format {fmt!r} is not one of {', '.join(FORMATS)}")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            seconds = f.frames / f.samplerate
            if seconds > limits.max_seconds:
                raise UserInputError(f"{what} is {seconds:.1f} s long; the limit is {limits.max_seconds:g} s")
            samples, source_rate = f.read(dtype="float32", always_2d=True), f.samplerate
    except UserInputError:
        raise
    except Exception as exc:   # libsndfile refuses broken or unknown data with several error kinds
        why = getattr(exc, "error_string", None) or str(exc)   # libsndfile's own reason, not the stream's repr
        raise UserInputError(f"{what} could not be decoded as WAV, FLAC, OGG or MP3: {why}") from None
    if samples.shape[0] == 0:
        raise UserInputError(f"{what} holds no samples")
    return to_mono_rate(samples, source_rate, rate, what)


def to_mono_rate(samples: np.ndarray, source_rate: int, rate: int, what: str = "audio") -> np.ndarray:
    """[N] or [N, channels] samples at `source_rate` -> [M] float32 at `rate` (channels averaged)."""
    import soxr

    x = np.asarray(samples, dtype=np.float32)
    if x.ndim == 2:
        x = x.mean(axis=1, dtype=np.float32)
    if x.ndim != 1:
        raise UserInputError(f"{what}: samples must be [N] or [N, channels], got shape {samples.shape}")
    if not np.isfinite(x).all():
        raise UserInputError(f"{what}: samples must be finite")
    if source_rate != rate:
        x = soxr.resample(x, source_rate, rate, quality="HQ").astype(np.float32, copy=False)
    return x


def decode_audio_data_url(url: str, rate: int, limits: AudioLimits, what: str = "audio") -> np.ndarray:
    """A `data:audio/...;base64,...` URL -> samples (nothing else: see images.data_url_bytes)."""
    return decode_audio_bytes(data_url_bytes(url, limits.max_bytes, what, "WAV/FLAC/OGG/MP3"), rate, limits,
                              what=what)


def decode_input_audio(part: dict, rate: int, limits: AudioLimits, what: str = "audio") -> np.ndarray:
    """OpenAI's `input_audio` content ({"data": base64, "format": "wav" | "mp3" | ...}) -> samples."""
    if not isinstance(part, dict) or not isinstance(part.get("data"), str):
        raise UserInputError(f'{what}: input_audio needs "data" (base64 audio) and "format"')
    fmt = part.get("format")
    if fmt is not None and not isinstance(fmt, str):
        raise UserInputError(f"{what}: input_audio format must be a string")
    return decode_audio_bytes(base64_bytes(part["data"], limits.max_bytes, what), rate, limits, fmt, what)


def load_audio(audio: object, rate: int, limits: AudioLimits, what: str = "audio") -> np.ndarray:
    """Float samples already at `rate` (numpy [N]), (samples, their rate), encoded bytes, a data URL, OpenAI's
    `input_audio` object or (the Python API's) a file path -> samples at `rate`, within the limits."""
    samples = _load_audio(audio, rate, limits, what)
    if len(samples) == 0:
        raise UserInputError(f"{what} holds no samples")
    if len(samples) > limits.max_seconds * rate:
        raise UserInputError(f"{what} is {len(samples) / rate:.1f} s long; the limit is {limits.max_seconds:g} s")
    return samples


def _load_audio(audio: object, rate: int, limits: AudioLimits, what: str) -> np.ndarray:
    if isinstance(audio, dict):
        return decode_input_audio(audio, rate, limits, what)
    if isinstance(audio, tuple) and len(audio) == 2 and isinstance(audio[1], int):
        return to_mono_rate(np.asarray(audio[0]), audio[1], rate, what)
    if isinstance(audio, np.ndarray):
        if audio.dtype.kind != "f":
            raise UserInputError(f"{what}: numpy samples must be floating point in [-1, 1], got {audio.dtype}")
        return to_mono_rate(audio, rate, rate, what)
    if isinstance(audio, (bytes, bytearray)):
        return decode_audio_bytes(bytes(audio), rate, limits, what=what)
    if isinstance(audio, str) and audio.startswith("data:"):
        return decode_audio_data_url(audio, rate, limits, what)
    if isinstance(audio, (str, Path)):
        path = Path(audio).expanduser()
        if not path.is_file():
            raise UserInputError(f"{what}: no such file {str(path)!r}")
        return decode_audio_bytes(path.read_bytes(), rate, limits, what=what)
    raise UserInputError(f"{what}: expected samples, (samples, rate), bytes, a data URL or a path, "
                         f"got {type(audio).__name__}")


def split_clips(samples: np.ndarray, max_samples: int, search: int = 0) -> list[np.ndarray]:
    """Consecutive clips of at most `max_samples`, covering every sample. With `search`, each cut is at the
    quietest 20 ms (at 16 kHz: 320 samples) of the `search` samples before the longest clip's end, so a cut falls
    in a pause rather than inside a word (the latest such window where several are equally quiet)."""
    out, start, n = [], 0, len(samples)
    window = 320
    while n - start > max_samples:
        end = start + max_samples
        if search >= 2 * window:
            lo = max(start + window, end - search)
            energy = np.square(samples[lo:end], dtype=np.float64)
            sums = np.convolve(energy, np.ones(window), mode="valid")   # energy of each window in [lo, end)
            best = len(sums) - 1 - int(np.argmin(sums[::-1]))             # the latest of the quietest
            end = lo + best + window // 2                                  # cut in the middle of it
        out.append(samples[start:end])
        start = end
    out.append(samples[start:])
    return out
