"""Gemma 4's audio tower (E2B/E4B, a Universal Speech Model conformer): log-mel frames to soft tokens
(gemma-architecture.md §5.6). Module and parameter names are the checkpoint's (`model.audio_tower.*`,
`model.embed_audio.*`) but for the attention's q/k/v projections (`q`, `k`, `v`: the text model's loader fuses
whatever it finds named q_proj/k_proj/v_proj); `checkpoint_name` maps them. From llama.cpp's mmproj file
(`--mmproj`): `AudioTowerConfig.from_gguf` and `mmproj_name`.

    features [T, 128] -> 2 x (conv 3x3 stride 2, LayerNorm, ReLU) -> [T/4, 32 x 32] -> linear -> [T/4, 1024]
    12 x conformer layer:
        x += 0.5 * FFN(x)                      clamp, RMSNorm, linear x4, SiLU, linear, clamp, RMSNorm
        x  = x + norm(attention(norm(x)))      local: each frame sees itself and the 11 before it; logits
                                               q.k + q.r(distance) (sinusoidal relative positions through
                                               their own projection), capped at 50 by tanh, q scaled per dim
                                               by softplus, k by log2(1 + e)
        x += light conv(x)                     RMSNorm, linear to 2H, GLU, causal depthwise conv (5), RMSNorm,
                                               SiLU, linear
        x += 0.5 * FFN(x), then RMSNorm
    output projection (bias) -> embed_audio (weightless RMSNorm, linear to the text width)

Frames the feature mask marks as padding are zeroed before each convolution, never attended to, and
carry no token. transformers computes the attention in blocks of 12 queries over 24 keys with a relative
shift; here it is the band itself (each query's 12 keys gathered), which gives the same logits (with its shift of
the relative positions where the chunk is not the window: `position_shift`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .audio_features import AudioFeatureConfig, AudioFeatureExtractor
from .fp32_conv import exact_fp32_convs
from .multimodal import EncoderInput


@dataclass(frozen=True)
class AudioTowerConfig:
    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536
    feature_size: int = 128   # mel bins of the features it reads
    # per_dim_scale as stored: the checkpoint's raw parameter (softplus applied at run time), or False where it
    # is already softplus(raw) (llama.cpp's mmproj files: its converter applies softplus when converting)
    raw_per_dim_scale: bool = True

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "AudioTowerConfig":
        """From a checkpoint's `audio_config`."""
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"audio tower activation {act!r} is not supported (Gemma 4's is silu)")
        if cfg.get("attention_context_right", 0):
            raise ValueError("an audio tower that attends to future frames (attention_context_right > 0) is not "
                             "supported")
        fields = {f: cfg[f] for f in cls.__dataclass_fields__ if f in cfg}
        if "subsampling_conv_channels" in fields:
            fields["subsampling_conv_channels"] = tuple(fields["subsampling_conv_channels"])
        return cls(**fields)

    @classmethod
    def from_gguf(cls, mmproj) -> "AudioTowerConfig":
        """From llama.cpp's mmproj file of a Gemma 4 model (projector type gemma4a; its converter's
        Gemma4VisionAudioModel, llama.cpp conversion/gemma.py). The file keeps hidden_size
        (clip.audio.embedding_length), num_hidden_layers (block_count), num_attention_heads (attention.head_count)
        and feature_size (num_mel_bins); the tensors say the subsampling channels (a.conv1d.0/1), the depthwise
        kernel (a.blk.0.conv_dw), output_proj_dims (a.pre_encode.out) and clipped linears (*.input_min present).
        clip.audio.feed_forward_length is the converter's 4 x hidden (ours too: checked against a.blk.0.ffn_up);
        clip.audio.attention.layer_norm_epsilon is a constant the converter writes (1e-5), not the model's, so it
        is not read. What the file does not keep is fixed for every Gemma 4 audio tower and taken from this
        class's defaults (those of transformers' Gemma4AudioConfig): rms_norm_eps 1e-6, attention chunk 12,
        left context 13, no right context, logit cap 50, invalid logit -1e9, residual weight 0.5, gradient
        clipping 1e10. per_dim_scale is stored as softplus(raw) (raw_per_dim_scale=False)."""
        tensors = mmproj.tensors_by_name()

        def shape(name: str) -> tuple[int, ...]:
            if name not in tensors:
                raise ValueError(f"lacks tensor {name!r}")
            return tensors[name].shape

        def key(name: str) -> int:
            value = mmproj.get(f"clip.audio.{name}")
            if value is None:
                raise ValueError(f"lacks clip.audio.{name}")
            return int(value)

        cfg = cls(hidden_size=key("embedding_length"), num_hidden_layers=key("block_count"),
                  num_attention_heads=key("attention.head_count"), feature_size=key("num_mel_bins"),
                  subsampling_conv_channels=(shape("a.conv1d.0.weight")[0], shape("a.conv1d.1.weight")[0]),
                  conv_kernel_size=shape("a.blk.0.conv_dw.weight")[-1],
                  output_proj_dims=shape("a.pre_encode.out.weight")[0],
                  use_clipped_linears=any(n.startswith("a.") and n.endswith(".input_min") for n in tensors),
                  raw_per_dim_scale=False)
        if shape("a.blk.0.ffn_up.weight") != (4 * cfg.hidden_size, cfg.hidden_size):
            raise ValueError(f"a.blk.0.ffn_up is {shape('a.blk.0.ffn_up.weight')}, expected "
                             f"{(4 * cfg.hidden_size, cfg.hidden_size)} (4 x the width {cfg.hidden_size})")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def window(self) -> int:
        """Keys a frame attends to: itself and the window - 1 before it."""
        return self.attention_context_left - 1

    @property
    def position_shift(self) -> int:
        """What transformers adds to a key's distance before its relative encoding. Its blocks of `chunk` queries
        read `chunk + window` keys and encodings of positions (chunk + window) // 2 .. 0, and its relative shift
        lines position p up with distance p - (chunk + window) // 2 + window: 0 for the checkpoints' geometry
        (chunk = window or window + 1), else every distance reads another's encoding (or none: zeros)."""
        return (self.attention_chunk_size + self.window) // 2 - self.window


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-0.5 (pow, as the checkpoint's reference computes it), times weight if any."""
    y = x.float() * torch.pow(x.float().pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (y if weight is None else y * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class ClippedLinear(nn.Module):
    """A bias-free linear whose input and output are clamped to ranges the checkpoint stores (or none)."""

    def __init__(self, cfg: AudioTowerConfig, n_in: int, n_out: int):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.clipped = cfg.use_clipped_linears
        if self.clipped:   # the checkpoint's ranges (parameters: the loader fills every one it names)
            for name in ("input_min", "input_max", "output_min", "output_max"):
                bound = torch.tensor(math.inf if name.endswith("max") else -math.inf)
                setattr(self, name, nn.Parameter(bound, requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        y = self.linear(x)
        return torch.clamp(y, self.output_min, self.output_max) if self.clipped else y


class FeedForward(nn.Module):
    def __init__(self, cfg: AudioTowerConfig):
        super().__init__()
        self.cfg = cfg
        self.pre_layer_norm = RMSNorm(cfg.hidden_size, 1e-6)
        self.ffw_layer_1 = ClippedLinear(cfg, cfg.hidden_size, 4 * cfg.hidden_size)
        self.ffw_layer_2 = ClippedLinear(cfg, 4 * cfg.hidden_size, cfg.hidden_size)
        self.post_layer_norm = RMSNorm(cfg.hidden_size, 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clip = min(self.cfg.gradient_clipping, torch.finfo(x.dtype).max)
        h = self.pre_layer_norm(torch.clamp(x, -clip, clip))
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(h)))
        return x + self.post_layer_norm(torch.clamp(h, -clip, clip)) * self.cfg.residual_weight


class LocalAttention(nn.Module):
    def __init__(self, cfg: AudioTowerConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.q, self.k, self.v = (ClippedLinear(cfg, h, h) for _ in range(3))
        self.post = ClippedLinear(cfg, h, h)
        self.relative_k_proj = nn.Linear(h, h, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(cfg.head_dim), requires_grad=False)
        # sinusoidal encodings by distance ([sin ; cos], timescales 1 .. 1e4): distance d reads position
        # d + cfg.position_shift, none (zeros) where that is negative, as transformers' blocked layout has it
        n = h // 2
        inv = torch.exp(torch.arange(n) * -(math.log(1e4) / max(n - 1, 1)))
        positions = torch.arange(cfg.window) + cfg.position_shift
        angles = positions.float()[:, None] * inv[None, :]
        enc = torch.cat([angles.sin(), angles.cos()], -1) * (positions >= 0)[:, None]
        self.register_buffer("distance_enc", enc, persistent=False)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x [T, H], valid [T] bool -> [T, H]: frame i attends to frames i - window + 1 .. i that are valid."""
        cfg, (t, _) = self.cfg, x.shape
        heads, d, w = cfg.num_attention_heads, cfg.head_dim, cfg.window
        q = self.q(x).float().view(t, heads, d)
        k = self.k(x).float().view(t, heads, d)
        v = self.v(x).float().view(t, heads, d)
        scale = F.softplus(self.per_dim_scale) if cfg.raw_per_dim_scale else self.per_dim_scale
        q = q * ((d ** -0.5) / math.log(2)) * scale
        k = k * (math.log(1 + math.e) / math.log(2))
        # the band: key j = i - dist for dist 0 .. w - 1 (keys before the clip read zeros, masked)
        index = torch.arange(t, device=x.device)[:, None] - torch.arange(w, device=x.device)[None, :]   # [T, w]
        inside = index >= 0
        keys = torch.cat([k.new_zeros(1, heads, d), k])[(index + 1).clamp(min=0)]     # [T, w, heads, d]
        values = torch.cat([v.new_zeros(1, heads, d), v])[(index + 1).clamp(min=0)]
        rel = self.relative_k_proj(self.distance_enc.to(x.dtype)).float().view(w, heads, d)   # by distance
        logits = torch.einsum("thd,twhd->thw", q, keys) + torch.einsum("thd,whd->thw", q, rel)
        cap = cfg.attention_logit_cap
        logits = torch.tanh(logits / cap) * cap
        visible = inside & valid[index.clamp(min=0)]                                      # [T, w]
        logits = logits.masked_fill(~visible[:, None, :], cfg.attention_invalid_logits_value)
        out = torch.einsum("thw,twhd->thd", logits.softmax(-1), values).reshape(t, heads * d)
        return self.post(out.to(x.dtype))


class LightConv(nn.Module):
    def __init__(self, cfg: AudioTowerConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.pre_layer_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.linear_start = ClippedLinear(cfg, h, 2 * h)
        self.depthwise_conv1d = nn.Conv1d(h, h, cfg.conv_kernel_size, groups=h, bias=False)
        self.conv_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.linear_end = ClippedLinear(cfg, h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        with exact_fp32_convs(h):
            h = self.depthwise_conv1d(F.pad(h.T[None], (self.cfg.conv_kernel_size - 1, 0)))[0].T   # causal
        clip = min(self.cfg.gradient_clipping, torch.finfo(h.dtype).max)
        return x + self.linear_end(F.silu(self.conv_norm(torch.clamp(h, -clip, clip))))


class ConformerLayer(nn.Module):
    def __init__(self, cfg: AudioTowerConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.feed_forward1 = FeedForward(cfg)
        self.norm_pre_attn = RMSNorm(h, 1e-6)
        self.self_attn = LocalAttention(cfg)
        self.norm_post_attn = RMSNorm(h, 1e-6)
        self.lconv1d = LightConv(cfg)
        self.feed_forward2 = FeedForward(cfg)
        self.norm_out = RMSNorm(h, 1e-6)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        clip = min(self.cfg.gradient_clipping, torch.finfo(self.norm_pre_attn.weight.dtype).max)
        x = self.feed_forward1(x)
        a = self.self_attn(self.norm_pre_attn(torch.clamp(x, -clip, clip)), valid)
        x = x + self.norm_post_attn(torch.clamp(a, -clip, clip))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(torch.clamp(x, -clip, clip))


class Subsample(nn.Module):
    """Two convolutions (3x3, stride 2, padding 1) over (frames, mel bins), each LayerNorm (no bias) + ReLU."""

    def __init__(self, cfg: AudioTowerConfig):
        super().__init__()
        c0, c1 = cfg.subsampling_conv_channels
        for i, (n_in, n_out) in enumerate(((1, c0), (c0, c1))):
            layer = nn.Module()
            layer.conv = nn.Conv2d(n_in, n_out, 3, stride=2, padding=1, bias=False)
            layer.norm = nn.LayerNorm(n_out, eps=cfg.rms_norm_eps, bias=False)
            self.add_module(f"layer{i}", layer)
        bins = -(-(-(-cfg.feature_size // 2)) // 2)   # mel bins after two stride-2 convolutions
        self.input_proj_linear = nn.Linear(bins * c1, cfg.hidden_size, bias=False)

    def forward(self, features: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = features[None, None]                                         # [1, 1, T, bins]
        for layer in (self.layer0, self.layer1):
            with exact_fp32_convs(x):
                x = layer.conv(x * valid[None, None, :, None].to(x.dtype))
            x = F.relu(layer.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
            valid = valid[::2]
        _, c, t, b = x.shape
        return self.input_proj_linear(x[0].permute(1, 2, 0).reshape(t, b * c)), valid


def checkpoint_name(name: str) -> str:
    """A checkpoint's tensor name under `audio_tower.` -> ours."""
    for part in ("q", "k", "v"):
        name = name.replace(f".self_attn.{part}_proj.", f".self_attn.{part}.")
    return name


# llama.cpp's mmproj names of a conformer layer's tensors (a.blk.N.<name>) -> ours (audio_tower.layers.N.<ours>),
# and whether ours is a ClippedLinear (its matrix under .linear, clip bounds beside it)
_MMPROJ_LAYER = {"ffn_up": ("feed_forward1.ffw_layer_1", True), "ffn_down": ("feed_forward1.ffw_layer_2", True),
                 "ffn_norm": ("feed_forward1.pre_layer_norm", False),
                 "ffn_post_norm": ("feed_forward1.post_layer_norm", False),
                 "ffn_up_1": ("feed_forward2.ffw_layer_1", True), "ffn_down_1": ("feed_forward2.ffw_layer_2", True),
                 "ffn_norm_1": ("feed_forward2.pre_layer_norm", False),
                 "ffn_post_norm_1": ("feed_forward2.post_layer_norm", False),
                 "attn_q": ("self_attn.q", True), "attn_k": ("self_attn.k", True), "attn_v": ("self_attn.v", True),
                 "attn_out": ("self_attn.post", True), "attn_k_rel": ("self_attn.relative_k_proj", False),
                 "conv_pw1": ("lconv1d.linear_start", True), "conv_pw2": ("lconv1d.linear_end", True),
                 "conv_dw": ("lconv1d.depthwise_conv1d", False), "conv_norm": ("lconv1d.pre_layer_norm", False),
                 "norm_conv": ("lconv1d.conv_norm", False), "attn_pre_norm": ("norm_pre_attn", False),
                 "attn_post_norm": ("norm_post_attn", False), "ln2": ("norm_out", False)}
_MMPROJ_GLOBAL = {"a.conv1d.0.weight": "subsample_conv_projection.layer0.conv.weight",
                  "a.conv1d.0.norm.weight": "subsample_conv_projection.layer0.norm.weight",
                  "a.conv1d.1.weight": "subsample_conv_projection.layer1.conv.weight",
                  "a.conv1d.1.norm.weight": "subsample_conv_projection.layer1.norm.weight",
                  "a.input_projection.weight": "subsample_conv_projection.input_proj_linear.weight",
                  "a.pre_encode.out.weight": "output_proj.weight", "a.pre_encode.out.bias": "output_proj.bias"}
_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def mmproj_name(name: str, value: torch.Tensor) -> tuple[str | None, torch.Tensor]:
    """An mmproj file's audio tensor (a.*) -> (our name under `audio_tower.`, its value in our layout), None where
    it is not one. The converter renames the checkpoint's (gguf's tensor map), drops `.linear` from the clipped
    linears, stores scalar clip bounds as [1] and the depthwise kernel [C, 1, K] as [C, K]: both undone exactly;
    per_dim_scale is softplus(raw), kept as it is (AudioTowerConfig.raw_per_dim_scale)."""
    if name in _MMPROJ_GLOBAL:
        return _MMPROJ_GLOBAL[name], value
    parts = name.split(".")
    if len(parts) != 5 or parts[:2] != ["a", "blk"] or not parts[2].isdigit():
        return None, value
    prefix, leaf = f"layers.{parts[2]}.", parts[4]
    if parts[3] == "per_dim_scale" and leaf == "weight":
        return prefix + "self_attn.per_dim_scale", value
    if parts[3] not in _MMPROJ_LAYER:
        return None, value
    ours, clipped = _MMPROJ_LAYER[parts[3]]
    if clipped and leaf in _BOUNDS:
        return f"{prefix}{ours}.{leaf}", value.reshape(())
    if leaf != "weight":
        return None, value
    if parts[3] == "conv_dw":
        value = value.unsqueeze(1)
    return f"{prefix}{ours}{'.linear' if clipped else ''}.weight", value


class AudioTower(nn.Module):
    """`audio_tower` of a Gemma 4 checkpoint: (features [T, 128], mask [T]) -> (tokens [T', output_proj_dims],
    their mask [T'])."""

    def __init__(self, cfg: AudioTowerConfig):
        super().__init__()
        self.cfg = cfg
        self.subsample_conv_projection = Subsample(cfg)
        self.layers = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.output_proj_dims, bias=True)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, valid = self.subsample_conv_projection(features, mask)
        for layer in self.layers:
            x = layer(x, valid)
        return self.output_proj(x), valid


class AudioEmbedder(nn.Module):
    """`embed_audio`: a weightless RMSNorm, then a projection to the text model's width."""

    def __init__(self, cfg: AudioTowerConfig, text_hidden_size: int):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.embedding_projection = nn.Linear(cfg.output_proj_dims, text_hidden_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms_norm(tokens, None, self.eps))


class AudioProcessor:
    """One clip's samples (mono, the extractor's rate, at most `max_samples`) -> its features and frame mask, and
    its token count: the frames left valid by the two stride-2 subsampling convolutions, as the tower's mask (and
    transformers' processor) count them."""

    def __init__(self, config: AudioFeatureConfig):
        self.config = config
        self.extractor = AudioFeatureExtractor(config)

    @property
    def max_tokens(self) -> int:
        return self.num_tokens(self.config.max_samples)

    @property
    def min_seconds(self) -> float:
        """The shortest clip that gives one token."""
        lo, hi = 1, self.config.max_samples
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.num_tokens(mid) else (mid + 1, hi)
        return lo / self.config.sampling_rate

    def num_tokens(self, num_samples: int) -> int:
        return int(self.extractor.valid_frames(num_samples)[::2][::2].sum())

    def __call__(self, samples: np.ndarray) -> EncoderInput:
        features, mask = self.extractor(samples)
        return EncoderInput(features, int(mask[::2][::2].sum()), mask)

