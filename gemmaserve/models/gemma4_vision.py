"""Gemma4ForConditionalGeneration: the Gemma 4 text model plus whichever of its encoders the checkpoint has,
the ViT image encoder (E2B/E4B and 26B/31B) and the conformer audio encoder (E2B/E4B, gemma4_audio.py); the
encoder-free 12B gemma4_unified is not covered.

    patches [N, P, 3 p^2] in [0, 1], positions [N, P, 2] (x, y; -1 = padding)
    -> Linear(2 (x - 0.5)) + pos_x[x] + pos_y[y]
    -> layers (Gemma 4 structure: 4 weighted RMSNorms, q/k norms, weightless v norm, scale 1, GeGLU,
       axial 2-D RoPE: half the head dims rotate with x, half with y; attention over one image's
       patches, padding keys masked; linears optionally clamped in and out)
    -> k x k average pool on the patch grid (row-major over the pooled grid), padding dropped
    -> * sqrt(Hv) in fp32 (26B/31B: (h - std_bias) * std_scale) -> dtype
    -> embed_vision: weightless RMSNorm, Linear(Hv -> H)      soft tokens, not scaled by sqrt(H)

Text side: `<boi>` + N x `<|image|>` + `<eoi>`, `<boa>` + N x `<|audio|>` + `<eoa>`; placeholder ids read the
pad row (and pad PLE row); with use_bidirectional_attention="vision" an image's tokens see each other on sliding
layers (audio tokens stay causal).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserInputError
from .base import ModelInputs, ModelPreferences
from .fused_ops import NormKind, rms_norm
from .gemma4 import Gemma4Config, Gemma4ForCausalLM
from .audio_features import AudioFeatureConfig
from .gemma4_audio import AudioEmbedder, AudioProcessor, AudioTower, AudioTowerConfig
from .gemma4_audio import checkpoint_name as audio_checkpoint_name
from .gemma4_audio import mmproj_name as audio_mmproj_name
from .image_processing import to_rgb
from .layers import RMSNorm
from .multimodal import EncoderInput, MediaLayout, Modality

log = logging.getLogger(__name__)

SOFT_TOKEN_CHOICES = (70, 140, 280, 560, 1120)


@dataclass(frozen=True)
class Gemma4VisionTowerConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    patch_size: int = 16
    position_embedding_size: int = 10240
    pooling_kernel_size: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    use_clipped_linears: bool = False
    standardize: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Gemma4VisionTowerConfig":
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise UserInputError(f"unsupported vision activation {cfg['hidden_activation']!r}")
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UserInputError(f"unsupported vision RoPE {rope.get('rope_type')!r} (Gemma 4 uses axial)")
        names = [f.name for f in cls.__dataclass_fields__.values() if f.name != "rope_theta"]
        return cls(**{k: cfg[k] for k in names if cfg.get(k) is not None}, rope_theta=float(rope.get("rope_theta", 100.0)))


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """A `Gemma4ForConditionalGeneration` checkpoint: the text model and whichever towers it has."""

    text: Gemma4Config
    vision: Gemma4VisionTowerConfig | None
    image_token_id: int = 258880
    boi_token_id: int = 255999
    eoi_token_id: int = 258882
    pad_token_id: int = 0
    max_soft_tokens: int = 280       # the image processor's budget per image (preprocessor_config.json)
    audio: AudioTowerConfig | None = None
    audio_token_id: int = 258881
    boa_token_id: int = 256000
    eoa_token_id: int = 258883
    audio_features: AudioFeatureConfig = AudioFeatureConfig()   # the checkpoint's feature extractor settings
    video_token_id: int = 258884
    video_soft_tokens: int = 70      # per frame (the video processor's max_soft_tokens)

    vocab_size = property(lambda self: self.text.vocab_size)
    max_position_embeddings = property(lambda self: self.text.max_position_embeddings)
    multimodal = property(lambda self: self.vision is not None or self.audio is not None)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Gemma4VisionConfig":
        text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
        soft = int(cfg.get("vision_soft_tokens_per_image") or 280)
        if soft not in SOFT_TOKEN_CHOICES:
            raise UserInputError(f"vision_soft_tokens_per_image must be one of {SOFT_TOKEN_CHOICES}, got {soft}")
        vision = Gemma4VisionTowerConfig.from_hf(cfg["vision_config"]) if cfg.get("vision_config") else None
        try:
            audio = AudioTowerConfig.from_hf(cfg["audio_config"]) if cfg.get("audio_config") else None
        except ValueError as exc:
            raise UserInputError(f"audio_config: {exc}") from None
        try:
            features = AudioFeatureConfig.from_hf((cfg.get("_processor") or {}).get("feature_extractor") or {})
        except (ValueError, TypeError) as exc:
            raise UserInputError(f"the checkpoint's audio feature extractor config: {exc}") from None

        def token(*names: str, default: int) -> int:
            return int(next((cfg[n] for n in names if cfg.get(n) is not None), default))

        video = (cfg.get("_processor") or {}).get("video_processor") or {}
        per_frame = int(video.get("max_soft_tokens") or 70)
        if per_frame not in SOFT_TOKEN_CHOICES:
            raise UserInputError(f"the video processor's max_soft_tokens must be one of {SOFT_TOKEN_CHOICES}, "
                                 f"got {per_frame}")

        return cls(text=Gemma4Config.from_hf(cfg), vision=vision, audio=audio,
                   image_token_id=token("image_token_id", default=258880),
                   boi_token_id=token("boi_token_id", default=255999), eoi_token_id=token("eoi_token_id", default=258882),
                   pad_token_id=int(text.get("pad_token_id") or 0), max_soft_tokens=soft,
                   audio_token_id=token("audio_token_id", default=258881),
                   boa_token_id=token("boa_token_id", "boa_token_index", default=256000),
                   eoa_token_id=token("eoa_token_id", "eoa_token_index", default=258883), audio_features=features,
                   video_token_id=token("video_token_id", default=258884), video_soft_tokens=per_frame)


    @classmethod
    def from_gguf(cls, text: Gemma4Config, mmproj, tokenizer) -> "Gemma4VisionConfig":
        """The text model of a gemma4 GGUF file plus the image encoder of llama.cpp's mmproj file for it (its
        converter's Gemma4VisionAudioModel, llama.cpp conversion/gemma.py; read by tools/mtmd/clip.cpp and
        models/gemma4v.cpp). The mmproj file keeps the tower's sizes (clip.vision.embedding_length,
        feed_forward_length, block_count, attention.head_count, attention.layer_norm_epsilon, patch_size,
        projection_dim = the text width, projector.scale_factor = the pooling kernel, 3 when absent) and its
        tensors say the rest: head_dim (attn_q_norm), KV heads (attn_k), the position table's size, clipped
        linears (*.input_min present), standardisation (v.std_bias present). What neither file keeps is taken as
        llama.cpp takes it: RoPE theta 100, 280 soft tokens per image at most; the image token ids are the
        tokenizer's `<|image>`, `<|image|>`, `<image|>` and `<|video|>`. Bidirectional image attention is what
        HF configures for the models without per-layer inputs (12B/26B/31B; E2B/E4B keep images causal,
        which llama.cpp does not: it makes every gemma4v image bidirectional).

        Its audio encoder (E2B/E4B: clip.has_audio_encoder, projector type gemma4a, tensors a.* and mm.a.*) is
        loaded too: the tower's sizes as AudioTowerConfig.from_gguf reads them, the feature extractor's defaults
        (those of transformers' Gemma4AudioFeatureExtractor: 16 kHz, 20 ms frames every 10 ms, ...; the file
        keeps none of them) with the file's mel bins, the audio token ids the tokenizer's `<|audio>`,
        `<|audio|>`, `<audio|>`."""
        if mmproj.get("general.architecture") != "clip":
            raise UserInputError(f"{mmproj.path} is not an mmproj file (general.architecture "
                                 f"{mmproj.get('general.architecture')!r}, expected 'clip')")
        kind = mmproj.get("clip.vision.projector_type", mmproj.get("clip.projector_type"))
        if kind == "gemma4uv":
            raise UserInputError(f"{mmproj.path} holds the 12B unified model's patch embedder (gemma4uv), which is "
                                 "not supported from mmproj files yet: serve its checkpoint directory for images")
        if not mmproj.get("clip.has_vision_encoder", False) or kind != "gemma4v":
            raise UserInputError(f"{mmproj.path} holds no Gemma 4 image encoder (projector type {kind!r}, "
                                 "expected 'gemma4v')")
        def check_width(key: str, what: str) -> None:
            width = mmproj.get(key)
            if width is not None and int(width) != text.hidden_size:
                raise UserInputError(f"{mmproj.path} projects {what} to width {width}, but the model's is "
                                     f"{text.hidden_size}: it belongs to another model")

        check_width("clip.vision.projection_dim", "images")
        has_audio = bool(mmproj.get("clip.has_audio_encoder", False))
        if has_audio:
            akind = mmproj.get("clip.audio.projector_type", mmproj.get("clip.projector_type"))
            if akind != "gemma4a":
                raise UserInputError(f"{mmproj.path} holds an audio encoder of projector type {akind!r}, not "
                                     "Gemma 4's ('gemma4a')")
            check_width("clip.audio.projection_dim", "audio")
        tensors = mmproj.tensors_by_name()

        def shape(name: str) -> tuple[int, ...]:
            if name not in tensors:
                raise UserInputError(f"{mmproj.path} lacks tensor {name!r}")
            return tensors[name].shape

        def key(name: str, default: Any = None) -> Any:
            value = mmproj.get(f"clip.vision.{name}", default)
            if value is None:
                raise UserInputError(f"{mmproj.path} lacks clip.vision.{name}")
            return value

        head_dim = shape("v.blk.0.attn_q_norm.weight")[0]
        vision = Gemma4VisionTowerConfig(
            hidden_size=int(key("embedding_length")), intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")), num_attention_heads=int(key("attention.head_count")),
            num_key_value_heads=shape("v.blk.0.attn_k.weight")[0] // head_dim, head_dim=head_dim,
            patch_size=int(key("patch_size")), position_embedding_size=shape("v.position_embd.weight")[1],
            pooling_kernel_size=int(key("projector.scale_factor", 3)),
            rms_norm_eps=float(f"{float(key('attention.layer_norm_epsilon', 1e-6)):.7g}"),   # GGUF: float32
            use_clipped_linears=any(n.endswith(".input_min") for n in tensors), standardize="v.std_bias" in tensors)

        def token(text_: str) -> int:
            tid = tokenizer.token_to_id(text_)
            if tid is None:
                raise UserInputError(f"the model's tokenizer has no {text_!r} token, which "
                                     f"{'audio needs' if 'audio' in text_ else 'images need'}")
            return tid

        text = dataclasses.replace(text, multimodal=True, bidirectional_vision=text.hidden_size_per_layer_input == 0,
                                   architecture="Gemma4ForConditionalGeneration")
        audio, audio_ids = None, {}
        if has_audio:
            try:
                audio = AudioTowerConfig.from_gguf(mmproj)
            except ValueError as exc:
                raise UserInputError(f"{mmproj.path}'s audio encoder: {exc}") from None
            audio_ids = dict(audio_token_id=token("<|audio|>"), boa_token_id=token("<|audio>"),
                             eoa_token_id=token("<audio|>"),
                             audio_features=AudioFeatureConfig(feature_size=audio.feature_size))
        return cls(text=text, vision=vision, image_token_id=token("<|image|>"), boi_token_id=token("<|image>"),
                   eoi_token_id=token("<image|>"), pad_token_id=tokenizer.pad_token_id,
                   video_token_id=tokenizer.token_to_id("<|video|>") or -1, audio=audio, **audio_ids)


@dataclass(frozen=True)
class Gemma4ImageProcessor:
    """Pillow + numpy, as transformers' Gemma4ImageProcessorPil: aspect-preserving bicubic resize to the
    largest size with sides a multiple of k*p and at most k^2 * max_soft_tokens patches, x / 255 (no
    normalisation), patches (py, px, c) row-major, padded to the budget with position (-1, -1)."""

    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        p, k = self.patch_size, self.pooling_kernel_size
        factor = math.sqrt(self.max_patches * p * p / (height * width))
        side = k * p
        th, tw = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
        longest = (self.max_patches // k ** 2) * side
        if th == 0 and tw == 0:
            raise UserInputError(f"image of {width}x{height} pixels cannot be resized for the vision encoder")
        if th == 0:
            th, tw = side, min(int(math.floor(width / height)) * side, longest)
        elif tw == 0:
            th, tw = min(int(math.floor(height / width)) * side, longest), side
        return th, tw

    def __call__(self, image) -> EncoderInput:
        from PIL import Image

        rgb = to_rgb(image)
        th, tw = self.target_size(rgb.height, rgb.width)
        if (rgb.height, rgb.width) != (th, tw):
            rgb = rgb.resize((tw, th), Image.Resampling.BICUBIC)
        return self.patches(np.asarray(rgb))

    def patches(self, rgb: np.ndarray) -> EncoderInput:
        """[H, W, 3] uint8 at its target size -> patches, token count and positions."""
        p = self.patch_size
        th, tw = rgb.shape[:2]
        ph, pw = th // p, tw // p
        # patches reordered while still bytes, then x / 255 in float32 straight into the padded buffer: bit for
        # bit transformers' float64 x * (1 / 255) rounded to float32 (the preprocessing tests compare exactly)
        pixels = rgb.reshape(ph, p, pw, p, 3).transpose(0, 2, 1, 3, 4).reshape(ph * pw, p * p * 3)
        patches = np.zeros((self.max_patches, p * p * 3), dtype=np.float32)
        np.divide(pixels, np.float32(255), out=patches[:ph * pw], dtype=np.float32)
        positions = np.full((self.max_patches, 2), -1, dtype=np.int64)
        positions[:ph * pw, 0] = np.tile(np.arange(pw), ph)
        positions[:ph * pw, 1] = np.repeat(np.arange(ph), pw)
        return EncoderInput(patches, ph * pw // self.pooling_kernel_size ** 2, positions)


@dataclass(frozen=True)
class Gemma4VideoFrameProcessor(Gemma4ImageProcessor):
    """A video frame as transformers' Gemma4VideoProcessor prepares it: the image processor's sizes and patches,
    but resized as torchvision resizes a uint8 tensor (antialiased bicubic on the bytes, which torch computes
    itself), and a smaller token budget per frame (70 by default)."""

    max_soft_tokens: int = 70

    def __call__(self, frame) -> EncoderInput:
        rgb = np.asarray(frame)
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise UserInputError(f"a video frame must be uint8 [H, W, 3], got {rgb.dtype} {rgb.shape}")
        th, tw = self.target_size(*rgb.shape[:2])
        return self.patches(resize_like_torchvision(rgb, th, tw))


def resize_like_torchvision(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, 3] uint8 resized as torchvision's resize(antialias=True, bicubic) resizes a uint8 tensor on the CPU:
    torch's own antialiased bicubic on the bytes (contiguous; unchanged at its size)."""
    if rgb.shape[:2] == (height, width):
        return np.ascontiguousarray(rgb)
    with warnings.catch_warnings():   # a PIL image's array is read-only; it is only read here, never copied
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None]
    x = F.interpolate(x, size=[height, width], mode="bicubic", antialias=True, align_corners=False)
    return np.ascontiguousarray(x[0].permute(1, 2, 0).numpy())


class ClippedLinear(nn.Module):
    """y = clamp(clamp(x, in bounds) W^T, out bounds): the E2B/E4B encoder keeps activations in the
    ranges it was quantisation-trained for (bounds are checkpoint values)."""

    def __init__(self, i: int, o: int, clipped: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(o, i, dtype=dtype), requires_grad=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                setattr(self, name, nn.Parameter(torch.empty((), dtype=dtype), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        y = F.linear(x, self.weight)
        return torch.clamp(y, self.output_min, self.output_max) if self.clipped else y


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Gemma4VisionLayer(nn.Module):
    def __init__(self, cfg: Gemma4VisionTowerConfig, dtype: torch.dtype):
        super().__init__()
        h, d, c = cfg.hidden_size, cfg.head_dim, cfg.use_clipped_linears
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.query = ClippedLinear(h, self.heads * d, c, dtype)
        self.key = ClippedLinear(h, self.kv_heads * d, c, dtype)
        self.value = ClippedLinear(h, self.kv_heads * d, c, dtype)
        self.out = ClippedLinear(self.heads * d, h, c, dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, 0.0)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, 0.0)
        self.gate = ClippedLinear(h, cfg.intermediate_size, c, dtype)
        self.up = ClippedLinear(h, cfg.intermediate_size, c, dtype)
        self.down = ClippedLinear(cfg.intermediate_size, h, c, dtype)
        self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm, \
            self.post_feedforward_layernorm = (RMSNorm(h, cfg.rms_norm_eps, dtype, 0.0) for _ in range(4))
        self.eps = cfg.rms_norm_eps

    def attention(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        d = self.head_dim
        half = d // 2
        cos, sin = cos_sin   # [N, P, D]: dims [0, D/2) rotate with x, [D/2, D) with y

        def rope(y: torch.Tensor) -> torch.Tensor:
            c, s = cos[:, :, None], sin[:, :, None]
            return torch.cat((_rotate(y[..., :half], c[..., :half], s[..., :half]),
                              _rotate(y[..., half:], c[..., half:], s[..., half:])), dim=-1)

        q = rope(self.q_norm(self.query(x).view(n, t, self.heads, d)))
        k = rope(self.k_norm(self.key(x).view(n, t, self.kv_heads, d)))
        v = rms_norm(self.value(x).view(n, t, self.kv_heads, d), torch.ones(d, dtype=x.dtype, device=x.device),
                     NormKind(self.eps, 0.0))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=keys[:, None, None, :], scale=1.0,
                                           enable_gqa=self.heads != self.kv_heads)
        return self.out(o.transpose(1, 2).reshape(n, t, self.heads * d))

    def forward(self, x: torch.Tensor, cos_sin, keys: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.attention(self.input_layernorm(x), cos_sin, keys))
        h = self.pre_feedforward_layernorm(x)
        return x + self.post_feedforward_layernorm(self.down(F.gelu(self.gate(h), approximate="tanh") * self.up(h)))


class Gemma4VisionTower(nn.Module):
    def __init__(self, cfg: Gemma4VisionTowerConfig, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.input_proj = nn.Parameter(torch.empty(h, 3 * cfg.patch_size ** 2, dtype=dtype), requires_grad=False)
        self.position_embedding_table = nn.Parameter(torch.empty(2, cfg.position_embedding_size, h, dtype=dtype),
                                                     requires_grad=False)
        self.layers = nn.ModuleList(Gemma4VisionLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        if cfg.standardize:
            self.std_bias = nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)
            self.std_scale = nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)
        d = cfg.head_dim // 2
        self.register_buffer("_inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d),
                             persistent=False)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """[N, P, 3 p^2], [N, P, 2] -> per image its pooled, scaled features [n_i, Hv] (model dtype)."""
        cfg, dtype = self.config, self.input_proj.dtype
        padding = (positions == -1).all(dim=-1)                                      # [N, P]
        pos = positions.clamp(min=0)
        x = F.linear((2 * (patches - 0.5)).to(dtype), self.input_proj)
        table = self.position_embedding_table
        x = x + torch.where(padding[..., None], 0.0, table[0][pos[..., 0]] + table[1][pos[..., 1]]).to(dtype)
        freqs = positions[..., None].float() * self._inv_freq                       # [N, P, 2, D/4]
        fx, fy = freqs[:, :, 0], freqs[:, :, 1]
        angles = torch.cat((fx, fx, fy, fy), dim=-1)
        cos_sin = (angles.cos().to(dtype), angles.sin().to(dtype))
        for layer in self.layers:
            x = layer(x, cos_sin, ~padding)
        # k x k average pool by patch position; padding patches are zeroed and land in cell 0.
        k = cfg.pooling_kernel_size
        length = patches.shape[1] // (k * k)
        x = x.masked_fill(padding[..., None], 0.0)
        cells = torch.div(pos, k, rounding_mode="floor")
        width = (pos[..., 0].max(dim=-1, keepdim=True).values + 1) // k
        weights = F.one_hot((cells[..., 0] + width * cells[..., 1]).long(), length).float() / (k * k)
        pooled = weights.transpose(1, 2) @ x.float()                                 # [N, length, Hv]
        valid = (weights != 0).any(dim=1)
        out = []
        for i in range(pooled.shape[0]):
            h = pooled[i][valid[i]] * cfg.hidden_size ** 0.5
            if cfg.standardize:
                h = (h - self.std_bias.float()) * self.std_scale.float()
            out.append(h.to(dtype))
        return out


class Gemma4VisionEmbedder(nn.Module):
    def __init__(self, hv: int, h: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Parameter(torch.empty(h, hv, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        return F.linear(rms_norm(x, ones, NormKind(self.eps, 0.0)), self.embedding_projection)


# Our vision parameter names -> the checkpoint's (theirs nest a `.linear`, and q/k/v/gate/up would be
# taken for the text model's stacked projections).
_RENAMES = (("self_attn.q_proj.", "query."), ("self_attn.k_proj.", "key."), ("self_attn.v_proj.", "value."),
            ("self_attn.o_proj.", "out."), ("self_attn.q_norm.", "q_norm."), ("self_attn.k_norm.", "k_norm."),
            ("mlp.gate_proj.", "gate."), ("mlp.up_proj.", "up."), ("mlp.down_proj.", "down."), ("linear.weight", "weight"))


# llama.cpp's mmproj names of a vision layer's tensors (v.blk.N.<name>) -> ours (vision_tower.layers.N.<ours>).
_MMPROJ_LAYER = {"attn_q": "query", "attn_k": "key", "attn_v": "value", "attn_out": "out", "attn_q_norm": "q_norm",
                 "attn_k_norm": "k_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
                 "ln1": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                 "ln2": "pre_feedforward_layernorm", "ffn_post_norm": "post_feedforward_layernorm"}
_MMPROJ_GLOBAL = {"v.std_bias": "vision_tower.std_bias", "v.std_scale": "vision_tower.std_scale",
                  "v.position_embd.weight": "vision_tower.position_embedding_table",
                  "v.patch_embd.weight": "vision_tower.input_proj",
                  "mm.input_projection.weight": "embed_vision.embedding_projection"}


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    config_class = Gemma4VisionConfig

    def __init__(self, cfg: Gemma4VisionConfig, dtype: torch.dtype = torch.float32):
        super().__init__(cfg.text, dtype)
        self.mm_config = cfg
        if cfg.vision is not None:   # a checkpoint may hold any subset of the towers
            self.vision_tower = Gemma4VisionTower(cfg.vision, dtype)
            self.embed_vision = Gemma4VisionEmbedder(cfg.vision.hidden_size, cfg.text.hidden_size,
                                                     cfg.vision.rms_norm_eps, dtype)
        if cfg.audio is not None:
            self.audio_tower = AudioTower(cfg.audio).to(dtype)
            self.embed_audio = AudioEmbedder(cfg.audio, cfg.text.hidden_size).to(dtype)

    def engine_preferences(self) -> ModelPreferences:
        return ModelPreferences(kv_cache_manager="v2", swa_scratch_reuse=False, kv_transfer_runtime="nixl")

    # -- what each modality reads (the 12B unified model swaps the processors) --------------------------------
    def image_processor(self, budget: int):
        v = self.mm_config.vision
        return Gemma4ImageProcessor(v.patch_size, v.pooling_kernel_size, budget)

    def video_processor(self, budget: int):
        v = self.mm_config.vision
        return Gemma4VideoFrameProcessor(v.patch_size, v.pooling_kernel_size, budget)

    def audio_processor(self):
        return AudioProcessor(self.mm_config.audio_features)

    def media_layouts(self) -> dict[Modality, MediaLayout]:
        """Images and video frames (`<boi>` + N soft tokens + `<eoi>`, a frame after its stamp) where the checkpoint
        has a vision part, audio (`<boa>` + N + `<eoa>`, causal) where it has an audio part."""
        cfg = self.mm_config

        def layout(modality: Modality, token_id: int, processor, max_tokens: int, begin: int, end: int,
                   bidirectional: bool = True) -> MediaLayout:
            return MediaLayout(modality, placeholder="", before="", token="", after="", token_id=token_id,
                               max_tokens=max_tokens, processor=processor, bidirectional=bidirectional,
                               begin_token_id=begin, end_token_id=end)

        out = {}
        if cfg.vision is not None:
            out[Modality.IMAGE] = layout(Modality.IMAGE, cfg.image_token_id, self.image_processor(cfg.max_soft_tokens),
                                         cfg.max_soft_tokens, cfg.boi_token_id, cfg.eoi_token_id)
            out[Modality.VIDEO] = layout(Modality.VIDEO, cfg.video_token_id,
                                         self.video_processor(cfg.video_soft_tokens), cfg.video_soft_tokens,
                                         cfg.boi_token_id, cfg.eoi_token_id)
        if cfg.audio is not None:
            proc = self.audio_processor()
            out[Modality.AUDIO] = layout(Modality.AUDIO, cfg.audio_token_id, proc, proc.max_tokens, cfg.boa_token_id,
                                         cfg.eoa_token_id, bidirectional=False)
        return out

    @property
    def image_layout(self) -> MediaLayout | None:
        return self.media_layouts().get(Modality.IMAGE)

    def encode_images(self, pixels: torch.Tensor, positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Patches [N, P, 3 p^2] and positions [N, P, 2] -> soft tokens of each image [n_i, H]."""
        return [self.embed_vision(h) for h in self.vision_tower(pixels, positions)]

    def encode_audio(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One clip's log-mel features [T, bins] and frame mask [T] -> its soft tokens [n, H] (valid frames only)."""
        tokens, valid = self.audio_tower(features.to(self.embed_audio.embedding_projection.weight.dtype), mask)
        return self.embed_audio(tokens[valid])

    def encode_media(self, modality: Modality, data: list[np.ndarray], extra: list, device: torch.device
                     ) -> list[torch.Tensor]:
        """Soft tokens [n_i, H] of each item (what EncoderInput holds): images together, clips one by one (the
        tower takes one clip; each is up to 30 s)."""
        if modality in (Modality.IMAGE, Modality.VIDEO):   # a video frame is encoded as an image
            return self.encode_images(torch.from_numpy(np.stack(data)).to(device),
                                      torch.from_numpy(np.stack(extra)).to(device))
        return [self.encode_audio(torch.from_numpy(d).to(device), torch.from_numpy(m).to(device))
                for d, m in zip(data, extra)]

    def _text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Soft-token ids read the pad row (of the embedding and per-layer tables), as transformers has it."""
        cfg = self.mm_config
        soft = (input_ids == cfg.image_token_id) | (input_ids == cfg.audio_token_id) | (input_ids == cfg.video_token_id)
        return input_ids.masked_fill(soft, cfg.pad_token_id)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.model.embed_tokens
        return table(self._text_ids(input_ids)) * torch.tensor(self.config.hidden_size ** 0.5).to(table.dtype)

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        if self.config.hidden_size_per_layer_input:
            inputs.input_ids = self._text_ids(inputs.input_ids)
        return super().forward(inputs)

    def mmproj_tensor(self, name: str, value: torch.Tensor) -> tuple[str | None, torch.Tensor]:
        """An mmproj file's tensor -> (our name, its value in our layout). The converter stores the patch embedding
        as a conv kernel [H, 3, p, p] (HF's linear over (py, px, c) permuted), and scalar clip bounds as [1]: both
        undone exactly. The audio encoder's (a.*, mm.a.*): gemma4_audio.mmproj_name."""
        if name == "mm.a.input_projection.weight":
            return "embed_audio.embedding_projection.weight", value
        if name.startswith("a."):
            ours, value = audio_mmproj_name(name, value)
            if ours is None:
                raise UserInputError(f"unexpected tensor {name!r} in a Gemma 4 mmproj file")
            return "audio_tower." + ours, value
        if name in _MMPROJ_GLOBAL:
            if name == "v.patch_embd.weight":
                value = value.permute(0, 2, 3, 1).reshape(value.shape[0], -1)
            return _MMPROJ_GLOBAL[name], value
        parts = name.split(".")
        if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and parts[3] in _MMPROJ_LAYER:
            leaf = parts[4]
            if leaf in ("input_min", "input_max", "output_min", "output_max"):
                return f"vision_tower.layers.{parts[2]}.{_MMPROJ_LAYER[parts[3]]}.{leaf}", value.reshape(())
            if leaf == "weight":
                return f"vision_tower.layers.{parts[2]}.{_MMPROJ_LAYER[parts[3]]}.weight", value
        raise UserInputError(f"unexpected tensor {name!r} in a Gemma 4 mmproj file")

    def checkpoint_name(self, name: str) -> str | None:
        for prefix, ours in (("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
                             ("model.embed_vision.", "embed_vision."), ("embed_vision.", "embed_vision.")):
            if name.startswith(prefix):
                rest = name[len(prefix):]
                rest = rest.replace("patch_embedder.input_proj.weight", "input_proj")
                rest = rest.replace("patch_embedder.", "").replace("encoder.layers.", "layers.")
                rest = rest.replace("embedding_projection.weight", "embedding_projection")
                for theirs, mine in _RENAMES:
                    rest = rest.replace(theirs, mine)
                return ours + rest
        bare = name.removeprefix("model.")
        if bare.startswith("audio_tower."):
            return "audio_tower." + audio_checkpoint_name(bare[len("audio_tower."):])
        if bare.startswith("embed_audio."):
            return bare
        return super().checkpoint_name(name)
