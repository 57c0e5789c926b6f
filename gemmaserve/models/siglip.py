"""SigLIP vision tower without its pooling head (the image encoder of Gemma 3 4B/12B/27B).

    pixels [N, 3, S, S] -> conv (kernel = stride = patch, bias) -> patches [N, (S/p)^2, Hv] row-major
    + learned position embedding (no CLS token)
    each layer (pre-LN):  x += attn(LN1(x));  x += fc2(gelu_tanh(fc1(LN2(x))))
    post LayerNorm -> [N, (S/p)^2, Hv]

Attention is full and unmasked over one image's patches, q/k/v/o with bias, scale head_dim^-1/2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserInputError
from .fp32_conv import exact_fp32_convs


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "SiglipConfig":
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UserInputError(f"unsupported SigLIP activation {act!r} (Gemma 3 uses gelu_pytorch_tanh)")
        return cls(hidden_size=cfg.get("hidden_size", 1152), intermediate_size=cfg.get("intermediate_size", 4304),
                   num_hidden_layers=cfg.get("num_hidden_layers", 27), num_attention_heads=cfg.get("num_attention_heads", 16),
                   image_size=cfg.get("image_size", 896), patch_size=cfg.get("patch_size", 14),
                   num_channels=cfg.get("num_channels", 3), layer_norm_eps=cfg.get("layer_norm_eps", 1e-6))


def _linear(i: int, o: int, dtype: torch.dtype) -> nn.Linear:
    # Built on the target device by the loader's device context; weights come from the checkpoint.
    return nn.Linear(i, o, bias=True, dtype=dtype).requires_grad_(False)


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipConfig, dtype: torch.dtype):
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        # Not q_proj/k_proj/v_proj: the text model stacks checkpoint tensors of those names (see
        # Gemma3ForConditionalGeneration.checkpoint_name).
        self.query, self.key, self.value, self.out_proj = (_linear(h, h, dtype) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, h = x.shape
        d = h // self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, self.heads, d).transpose(1, 2)

        o = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)),
                                           scale=d ** -0.5)
        return self.out_proj(o.transpose(1, 2).reshape(n, t, h))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: SiglipConfig, dtype: torch.dtype):
        super().__init__()
        self.fc1 = _linear(cfg.hidden_size, cfg.intermediate_size, dtype)
        self.fc2 = _linear(cfg.intermediate_size, cfg.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig, dtype: torch.dtype):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(h, eps=eps, dtype=dtype).requires_grad_(False)
        self.self_attn = SiglipAttention(cfg, dtype)
        self.layer_norm2 = nn.LayerNorm(h, eps=eps, dtype=dtype).requires_grad_(False)
        self.mlp = SiglipMLP(cfg, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig, dtype: torch.dtype):
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size,
                                         padding="valid", dtype=dtype).requires_grad_(False)
        self.position_embedding = nn.Embedding(cfg.patches_per_side ** 2, cfg.hidden_size, dtype=dtype,
                                               _freeze=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = pixels.to(self.patch_embedding.weight.dtype)
        with exact_fp32_convs(pixels):
            patches = self.patch_embedding(pixels)   # [N, Hv, g, g]
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """Parameter names follow transformers' SiglipVisionTransformer (embeddings, encoder.layers, post_layernorm),
    except attention's q/k/v_proj, here query/key/value."""

    def __init__(self, cfg: SiglipConfig, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        self.embeddings = SiglipEmbeddings(cfg, dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipEncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype).requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, C, S, S] -> last hidden state [N, (S/p)^2, Hv]."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
