"""Gemma 4's audio features: 16 kHz mono samples to log-mel frames (gemma-architecture.md §5.6).

    pad      the clip with zeros to a multiple of `pad_to_multiple_of` samples (128), then `frame_length // 2`
             zeros on the left (semicausal: frame i ends on the clip's sample (i + 1) * hop)
    frames   `frame_length` samples (20 ms: 320) every `hop` (10 ms: 160), optional pre-emphasis, a periodic
             Hann window, a real FFT of `fft_length` (the next power of two: 512), magnitudes |X|
    mel      `feature_size` (128) triangular filters, evenly spaced on the HTK mel scale between
             `min_frequency` and `max_frequency` (0-8 kHz), unnormalised; log(mel + mel_floor), then the
             checkpoint's per-bin mean and standard deviation, if it has them
    mask     a frame is real where its last sample is a sample of the clip (not padding); the others' features
             are zero

Samples, window, FFT, filters and log in float32: transformers' `Gemma4AudioFeatureExtractor` takes the same
numpy FFT (float32 in, float32 out) and applies the filters and the log in float64; the features differ from its
by under 1e-6 (its float64 product costs twice ours). The FFT must stay numpy's: torch's, or a float64 one,
differs by up to 5e-4 where speech is quiet, as the log magnifies the smallest bins.
A clip longer than `max_samples` (30 s) is not cut here: the caller splits or refuses it (engine/media/audio.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


def hz_to_mel(f: np.ndarray | float) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + np.asarray(f, dtype=np.float64) / 700.0)


def mel_to_hz(m: np.ndarray | float) -> np.ndarray:
    return 700.0 * (10.0 ** (np.asarray(m, dtype=np.float64) / 2595.0) - 1.0)


def mel_filters(num_bins: int, num_filters: int, min_hz: float, max_hz: float, sampling_rate: int) -> np.ndarray:
    """[num_bins, num_filters]: filter j rises linearly from edge j to edge j + 1 and falls to edge j + 2, the
    num_filters + 2 edges evenly spaced in HTK mel between min_hz and max_hz; bins at 0 .. sampling_rate // 2."""
    edges = mel_to_hz(np.linspace(hz_to_mel(min_hz), hz_to_mel(max_hz), num_filters + 2))
    bins = np.linspace(0, sampling_rate // 2, num_bins)
    width = np.diff(edges)
    offset = edges[None, :] - bins[:, None]                     # [bins, edges]: edge - bin frequency
    rising = -offset[:, :-2] / width[:-1]                       # (bin - left edge) / (centre - left edge)
    falling = offset[:, 2:] / width[1:]                         # (right edge - bin) / (right edge - centre)
    return np.maximum(0.0, np.minimum(rising, falling))


@dataclass(frozen=True)
class AudioFeatureConfig:
    feature_size: int = 128
    sampling_rate: int = 16_000
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    preemphasis: float = 0.0
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = False
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-3
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    pad_to_multiple_of: int = 128
    max_samples: int = 480_000   # 30 s: what the audio tower takes at once (750 tokens)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "AudioFeatureConfig":
        """From a checkpoint's feature extractor config (`preprocessor_config.json` or the processor's
        `feature_extractor` entry). Dithering (random noise) is refused: it would make features differ per call."""
        if float(cfg.get("dither", 0.0) or 0.0) != 0.0:
            raise ValueError(f"audio dithering ({cfg['dither']}) is not supported: features would be random")
        known = {f: cfg[f] for f in cls.__dataclass_fields__ if f in cfg and f != "max_samples"}
        if cfg.get("max_length"):
            known["max_samples"] = int(cfg["max_length"])
        for key in ("per_bin_mean", "per_bin_stddev"):
            if known.get(key) is not None:   # saved as given, or as the [1, 1, bins] array it was reshaped to
                known[key] = tuple(float(v) for v in np.asarray(known[key], dtype=np.float64).ravel())
        return cls(**known)

    @property
    def frame_length(self) -> int:
        return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

    @property
    def hop(self) -> int:
        return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

    @property
    def fft_length(self) -> int:
        n = 2 ** math.ceil(math.log2(self.frame_length))
        return 2 * n if self.fft_overdrive else n


class AudioFeatureExtractor:
    def __init__(self, config: AudioFeatureConfig = AudioFeatureConfig()):
        self.config = c = config
        n = c.frame_length
        self.window = (0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)).astype(np.float32)   # periodic Hann
        self.filters = mel_filters(c.fft_length // 2 + 1, c.feature_size, c.min_frequency, c.max_frequency,
                                   c.sampling_rate)
        # the product in float32 (2x faster than transformers' float64 one): features within 1e-6 of its
        self.filters32 = self.filters.astype(np.float32)
        self.mean = None if c.per_bin_mean is None else np.asarray(c.per_bin_mean, dtype=np.float64)
        self.std = None if c.per_bin_stddev is None else np.asarray(c.per_bin_stddev, dtype=np.float64)

    def num_frames(self, num_samples: int) -> int:
        """Frames of a clip of `num_samples` (padding frames included)."""
        c = self.config
        padded = -(-num_samples // c.pad_to_multiple_of) * c.pad_to_multiple_of + c.frame_length // 2
        return max(0, (padded - c.frame_length - 1) // c.hop + 1)

    def valid_frames(self, num_samples: int) -> np.ndarray:
        """[frames] bool: the frames of a clip of `num_samples` that end on one of its samples."""
        c = self.config
        last = np.arange(self.num_frames(num_samples)) * c.hop + c.frame_length - c.frame_length // 2
        return last < num_samples

    def __call__(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`samples` [N] (mono, `sampling_rate`, N <= max_samples) -> (features [T, feature_size] float32,
        mask [T] bool: the frames that end on a sample of the clip)."""
        c = self.config
        x = np.asarray(samples, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"audio samples must be one channel, got shape {x.shape}")
        if len(x) > c.max_samples:
            raise ValueError(f"a clip of {len(x)} samples is longer than the {c.max_samples} the model takes")
        if c.input_scale_factor != 1.0:
            x = x * c.input_scale_factor
        n, left = len(x), c.frame_length // 2
        total = -(-n // c.pad_to_multiple_of) * c.pad_to_multiple_of
        padded = np.zeros(left + total, dtype=np.float32)
        padded[left:left + n] = x
        t = self.num_frames(n)
        if t == 0:   # shorter than one frame
            return np.zeros((0, c.feature_size), dtype=np.float32), np.zeros(0, dtype=bool)
        # frame i reads samples [i * hop, i * hop + frame_length] of the padded clip (one more than the frame
        # holds: the sample before each one feeds the pre-emphasis); a strided view, no copy
        raw = np.lib.stride_tricks.sliding_window_view(padded, c.frame_length + 1)[::c.hop][:t]
        if c.preemphasis > 0.0 and c.preemphasis_htk_flavor:
            frames = np.concatenate([raw[:, :1] * (1.0 - c.preemphasis),
                                     raw[:, 1:-1] - c.preemphasis * raw[:, :-2]], axis=1)
        elif c.preemphasis > 0.0:
            frames = raw[:, 1:] - c.preemphasis * raw[:, :-1]
        else:
            frames = raw[:, :-1]
        # numpy's float32 FFT, as transformers': torch's (1.4x faster) differs by ~1e-7 of the largest bin, which
        # the log turns into up to 5e-4 where speech is quiet
        spectrum = np.fft.rfft(frames * self.window, n=c.fft_length, axis=-1)
        magnitude = np.sqrt(spectrum.real ** 2 + spectrum.imag ** 2)
        features = np.log(magnitude @ self.filters32 + np.float32(c.mel_floor))
        if self.mean is not None:
            features = features - self.mean
        if self.std is not None:
            features = features / self.std
        mask = self.valid_frames(n)
        features = features.astype(np.float32)
        features[~mask] = 0.0
        return features, mask
