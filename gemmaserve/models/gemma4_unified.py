"""Gemma4UnifiedForConditionalGeneration (the 12B `gemma4_unified`): the Gemma 4 text model with no image or audio
encoder. Images and video frames are cut into 48 x 48 pixel patches that a few norms and one projection turn into
soft tokens; audio is raw 40 ms waveform frames through one projection.

    image / frame  aspect-preserving resize to sides that are multiples of 48 px within max_soft_tokens patches
                   (as torchvision resizes uint8 pixels: antialiased bicubic), x * (1 / 255) in float32
                   -> 48 x 48 x 3 patches row-major, (x, y) positions, padded to max_soft_tokens with (-1, -1)
                   -> LayerNorm, Linear (bias), LayerNorm, + pos[x, 0] + pos[y, 1], LayerNorm
                   -> weightless RMSNorm, Linear to the text width: one soft token per patch
    audio          zero-padded to a multiple of 640 samples -> [n, 640] frames -> weightless RMSNorm, Linear:
                   one soft token per frame (at most 750 a clip: 30 s)

The prompt layout, the pad-row reading of soft-token ids and the image mask are Gemma 4's
(Gemma4ForConditionalGeneration); audio is causal. With use_bidirectional_attention="vision" (the 12B's setting)
an image's tokens see each other on sliding layers within the window and full layers stay causal: the Google
reference rule, which transformers' `create_masks_for_generate` applies (the 12B's `forward` in transformers
5.24-5.25 still ORs the image block into both masks, which the reference does not: gemma-architecture.md §5.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import UserInputError
from .gemma4 import Gemma4Config, Gemma4ForCausalLM
from .gemma4_vision import (SOFT_TOKEN_CHOICES, Gemma4ForConditionalGeneration, Gemma4ImageProcessor,
                            resize_like_torchvision)
from .image_processing import to_rgb
from .multimodal import EncoderInput, Modality


@dataclass(frozen=True)
class UnifiedVisionConfig:
    patch_size: int = 16             # the resize's unit; patches are pooling_kernel_size times larger
    pooling_kernel_size: int = 3
    mm_embed_dim: int = 3840
    mm_posemb_size: int = 1120
    output_proj_dims: int = 3840
    rms_norm_eps: float = 1e-6

    @property
    def model_patch_size(self) -> int:
        return self.patch_size * self.pooling_kernel_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "UnifiedVisionConfig":
        return cls(**{k: cfg[k] for k in cls.__dataclass_fields__ if cfg.get(k) is not None})


@dataclass(frozen=True)
class RawAudioConfig:
    """The unified model's audio "features": the waveform itself, `samples_per_token` samples a token."""

    audio_embed_dim: int = 640       # = samples per token
    rms_norm_eps: float = 1e-6
    sampling_rate: int = 16_000
    max_tokens: int = 750            # a clip (the processor's audio_seq_length): 30 s

    @property
    def max_samples(self) -> int:
        return self.max_tokens * self.audio_embed_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], max_tokens: int) -> "RawAudioConfig":
        return cls(int(cfg.get("audio_embed_dim") or 640), float(cfg.get("rms_norm_eps") or 1e-6),
                   max_tokens=max_tokens)


@dataclass(frozen=True)
class Gemma4UnifiedConfig:
    """A `Gemma4UnifiedForConditionalGeneration` checkpoint; the attributes Gemma4ForConditionalGeneration's
    shared code reads (token ids, video budget) have its names."""

    text: Gemma4Config
    vision: UnifiedVisionConfig | None
    audio: RawAudioConfig | None
    image_token_id: int = 258880
    boi_token_id: int = 255999
    eoi_token_id: int = 258882
    audio_token_id: int = 258881
    boa_token_id: int = 256000
    eoa_token_id: int = 258883
    video_token_id: int = 258884
    pad_token_id: int = 0
    max_soft_tokens: int = 280       # per image (the image processor's budget)
    video_soft_tokens: int = 70      # per frame

    vocab_size = property(lambda self: self.text.vocab_size)
    max_position_embeddings = property(lambda self: self.text.max_position_embeddings)
    multimodal = property(lambda self: self.vision is not None or self.audio is not None)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Gemma4UnifiedConfig":
        text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
        processor = cfg.get("_processor") or {}

        def budget(part: str, default: int) -> int:
            n = int((processor.get(part) or {}).get("max_soft_tokens") or default)
            if n not in SOFT_TOKEN_CHOICES:
                raise UserInputError(f"the {part}'s max_soft_tokens must be one of {SOFT_TOKEN_CHOICES}, got {n}")
            return n

        def token(*names: str, default: int) -> int:
            return int(next((cfg[n] for n in names if cfg.get(n) is not None), default))

        vision = UnifiedVisionConfig.from_hf(cfg["vision_config"]) if cfg.get("vision_config") else None
        # at most 750 tokens a clip (30 s), the processor's audio_seq_length
        audio = RawAudioConfig.from_hf(cfg["audio_config"], 750) if cfg.get("audio_config") else None
        return cls(text=Gemma4Config.from_hf(cfg), vision=vision, audio=audio,
                   image_token_id=token("image_token_id", default=258880),
                   boi_token_id=token("boi_token_id", default=255999), eoi_token_id=token("eoi_token_id", default=258882),
                   audio_token_id=token("audio_token_id", default=258881),
                   boa_token_id=token("boa_token_id", "boa_token_index", default=256000),
                   eoa_token_id=token("eoa_token_id", "eoa_token_index", default=258883),
                   video_token_id=token("video_token_id", default=258884), pad_token_id=int(text.get("pad_token_id") or 0),
                   max_soft_tokens=budget("image_processor", 280), video_soft_tokens=budget("video_processor", 70))


@dataclass(frozen=True)
class UnifiedPatchProcessor(Gemma4ImageProcessor):
    """An image or video frame as transformers' Gemma4UnifiedImageProcessor prepares it: Gemma 4's target size (in
    units of `patch_size`, `max_soft_tokens` x k^2 of them), resized as torchvision resizes uint8 pixels, x * (1 / 255)
    in float32, then k x k units merged into one patch each (row-major within and across patches)."""

    def __call__(self, image) -> EncoderInput:
        rgb = image if isinstance(image, np.ndarray) else np.asarray(to_rgb(image))
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise UserInputError(f"an image must be uint8 [H, W, 3], got {rgb.dtype} {rgb.shape}")
        th, tw = self.target_size(*rgb.shape[:2])
        rgb = resize_like_torchvision(rgb, th, tw)
        side = self.patch_size * self.pooling_kernel_size
        ph, pw = th // side, tw // side
        n = ph * pw
        pixels = rgb.reshape(ph, side, pw, side, 3).transpose(0, 2, 1, 3, 4).reshape(n, side * side * 3)
        patches = np.zeros((self.max_soft_tokens, side * side * 3), dtype=np.float32)
        np.multiply(pixels, np.float32(1 / 255), out=patches[:n], dtype=np.float32)   # torch's x * (1 / 255)
        positions = np.full((self.max_soft_tokens, 2), -1, dtype=np.int64)
        positions[:n, 0] = np.tile(np.arange(pw), ph)
        positions[:n, 1] = np.repeat(np.arange(ph), pw)
        return EncoderInput(patches, n, positions)


class RawAudioProcessor:
    """One clip's samples -> [n, 640] frames (the last zero-padded), every one a token."""

    def __init__(self, config: RawAudioConfig):
        self.config = config

    @property
    def max_tokens(self) -> int:
        return self.config.max_tokens

    @property
    def min_seconds(self) -> float:
        return 1 / self.config.sampling_rate

    def __call__(self, samples: np.ndarray) -> EncoderInput:
        x = np.asarray(samples, dtype=np.float32)
        per = self.config.audio_embed_dim
        n = -(-len(x) // per)
        frames = np.zeros((n, per), dtype=np.float32)
        frames.reshape(-1)[:len(x)] = x
        return EncoderInput(frames, n, np.ones(n, dtype=bool))


def _rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm in float32 (x * (mean(x^2) + eps)^-1/2), back in x's dtype."""
    y = x.float()
    return (y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


class MultimodalEmbedder(nn.Module):
    def __init__(self, width: int, text_width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(width, text_width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(_rms_norm(x.to(self.embedding_projection.weight.dtype), self.eps))


class VisionEmbedder(nn.Module):
    """`embed_vision`: patches [N, P, 3 s^2] and positions [N, P, 2] -> soft tokens of the valid patches."""

    def __init__(self, cfg: UnifiedVisionConfig, text_width: int):
        super().__init__()
        width = cfg.model_patch_size ** 2 * 3
        self.patch_ln1 = nn.LayerNorm(width)
        self.patch_dense = nn.Linear(width, cfg.mm_embed_dim)
        self.patch_ln2 = nn.LayerNorm(cfg.mm_embed_dim)
        self.pos_embedding = nn.Parameter(torch.zeros(cfg.mm_posemb_size, 2, cfg.mm_embed_dim))
        self.pos_norm = nn.LayerNorm(cfg.mm_embed_dim)
        self.multimodal_embedder = MultimodalEmbedder(cfg.output_proj_dims, text_width, cfg.rms_norm_eps)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        x = self.patch_ln2(self.patch_dense(self.patch_ln1(patches.to(self.patch_dense.weight.dtype))))
        valid = (positions != -1).all(dim=-1)
        pos = self.pos_embedding[positions.clamp(min=0), torch.arange(2, device=positions.device)]   # [N, P, 2, D]
        x = self.pos_norm(x + (pos * valid[..., None, None].to(pos.dtype)).sum(-2))
        tokens = self.multimodal_embedder(x)
        return [t[v] for t, v in zip(tokens, valid)]


class Gemma4UnifiedForConditionalGeneration(Gemma4ForConditionalGeneration):
    config_class = Gemma4UnifiedConfig

    def __init__(self, cfg: Gemma4UnifiedConfig, dtype: torch.dtype = torch.float32):
        Gemma4ForCausalLM.__init__(self, cfg.text, dtype)
        self.mm_config = cfg
        if cfg.vision is not None:
            self.embed_vision = VisionEmbedder(cfg.vision, cfg.text.hidden_size).to(dtype)
        if cfg.audio is not None:
            self.embed_audio = MultimodalEmbedder(cfg.audio.audio_embed_dim, cfg.text.hidden_size,
                                                  cfg.audio.rms_norm_eps).to(dtype)

    def image_processor(self, budget: int):
        v = self.mm_config.vision
        return UnifiedPatchProcessor(v.patch_size, v.pooling_kernel_size, budget)

    video_processor = image_processor   # frames are patched as images, at the video budget

    def audio_processor(self):
        return RawAudioProcessor(self.mm_config.audio)

    def encode_media(self, modality: Modality, data: list[np.ndarray], extra: list, device: torch.device
                     ) -> list[torch.Tensor]:
        """Soft tokens [n_i, H] of each item: images and frames together, clips one by one."""
        if modality in (Modality.IMAGE, Modality.VIDEO):
            return self.embed_vision(torch.from_numpy(np.stack(data)).to(device),
                                     torch.from_numpy(np.stack(extra)).to(device))
        return [self.embed_audio(torch.from_numpy(d).to(device)) for d in data]

    def checkpoint_name(self, name: str) -> str | None:
        """Checkpoints keep the patch embedding under `vision_embedder.` and the vision projection as
        `embed_vision.embedding_projection` (transformers renames both on load; its own state dict names pass too)."""
        bare = name.removeprefix("model.")
        if bare.startswith("vision_embedder."):
            return "embed_vision." + bare[len("vision_embedder."):]
        if bare.startswith("embed_vision.embedding_projection."):
            return "embed_vision.multimodal_embedder." + bare[len("embed_vision."):]
        if bare.startswith(("embed_vision.", "embed_audio.")):
            return bare
        return Gemma4ForCausalLM.checkpoint_name(self, name)


