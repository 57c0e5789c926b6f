"""Gemma3ForConditionalGeneration: the Gemma 3 text model plus a SigLIP image encoder.

    pixels [N, 3, 896, 896] -> SigLIP (no head) [N, 4096, Hv] -> 4x4 average pool on the 64x64 grid
    -> [N, 256, Hv] row-major -> RMSNorm(1 + w) -> @ W [Hv, H] -> soft tokens [N, 256, H] (not scaled)

The engine scatters soft tokens over the image-token rows of the scaled token embeddings
(`embed`), and every attention layer lets the tokens of one image see each other (HF 5.x:
full = causal | same image, sliding = (causal | same image) & window).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserInputError
from .base import ModelPreferences
from .fused_ops import rms_norm
from .gemma3 import Gemma3Config, Gemma3ForCausalLM
from .image_processing import ImageProcessor
from .layers import RMSNorm
from .multimodal import MediaLayout, Modality
from .siglip import SiglipConfig, SiglipVisionTower

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
_SIGLIP_RENAMES = ((".self_attn.query.", ".self_attn.q_proj."), (".self_attn.key.", ".self_attn.k_proj."),
                   (".self_attn.value.", ".self_attn.v_proj."))


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """The whole multimodal checkpoint: text config (as Gemma3ForCausalLM reads it) plus the image parts."""

    text: Gemma3Config
    vision: SiglipConfig
    mm_tokens_per_image: int = 256
    image_token_id: int = 262144
    boi_token_id: int = 255999
    eoi_token_id: int = 256000

    def __post_init__(self) -> None:
        side = int(round(self.mm_tokens_per_image ** 0.5))
        grid = self.vision.patches_per_side
        if side * side != self.mm_tokens_per_image or grid % side:
            raise UserInputError(f"mm_tokens_per_image {self.mm_tokens_per_image} does not pool a {grid}x{grid} grid")

    # The engine reads these of any model config.
    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.text.max_position_embeddings

    @property
    def multimodal(self) -> bool:
        return True

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Gemma3VisionConfig":
        if "vision_config" not in cfg:
            raise UserInputError("a Gemma3ForConditionalGeneration config needs a vision_config")
        vision = cfg["vision_config"] or {}
        if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise UserInputError(f"unsupported Gemma 3 vision tower {vision.get('model_type')!r} (expected SigLIP)")

        def pick(*names: str, default: int) -> int:
            for n in names:
                if cfg.get(n) is not None:
                    return int(cfg[n])
            return default
        return cls(text=Gemma3Config.from_hf(cfg), vision=SiglipConfig.from_hf(vision),
                   mm_tokens_per_image=pick("mm_tokens_per_image", default=256),
                   image_token_id=pick("image_token_id", "image_token_index", default=262144),
                   boi_token_id=pick("boi_token_id", "boi_token_index", default=255999),
                   eoi_token_id=pick("eoi_token_id", "eoi_token_index", default=256000))


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, cfg: Gemma3VisionConfig, dtype: torch.dtype):
        super().__init__()
        hv = cfg.vision.hidden_size
        self.mm_input_projection_weight = nn.Parameter(torch.empty(hv, cfg.text.hidden_size, dtype=dtype),
                                                       requires_grad=False)
        self.mm_soft_emb_norm = RMSNorm(hv, cfg.vision.layer_norm_eps, dtype)
        self.grid = cfg.vision.patches_per_side
        self.kernel = self.grid // int(round(cfg.mm_tokens_per_image ** 0.5))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        n, _, hv = hidden.shape
        grid = hidden.transpose(1, 2).reshape(n, hv, self.grid, self.grid)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)   # [N, tokens, Hv]
        normed = rms_norm(pooled, self.mm_soft_emb_norm.weight, self.mm_soft_emb_norm.kind)
        return torch.matmul(normed, self.mm_input_projection_weight).to(hidden.dtype)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    config_class = Gemma3VisionConfig

    def __init__(self, cfg: Gemma3VisionConfig, dtype: torch.dtype = torch.float32):
        super().__init__(replace(cfg.text, multimodal=True, image_bidirectional=True), dtype)
        self.mm_config = cfg
        self.vision_tower = SiglipVisionTower(cfg.vision, dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg, dtype)

    def engine_preferences(self) -> ModelPreferences:
        # Scratch pages would hold an image's keys only until the next layer: off (seed 004).
        return ModelPreferences(kv_cache_manager="v2", swa_scratch_reuse=False, kv_transfer_runtime="nixl")

    # -- images ----------------------------------------------------------------------------------
    @property
    def image_layout(self) -> MediaLayout:
        n = self.mm_config.mm_tokens_per_image
        return MediaLayout(Modality.IMAGE, placeholder=BOI, before=f"\n\n{BOI}", token=IMAGE, after=f"{EOI}\n\n",
                           token_id=self.mm_config.image_token_id, max_tokens=n,
                           processor=ImageProcessor(self.mm_config.vision.image_size, n))

    def media_layouts(self) -> dict[Modality, MediaLayout]:
        return {Modality.IMAGE: self.image_layout}

    def encode_media(self, modality: Modality, data: list[np.ndarray], extra: list, device: torch.device
                     ) -> list[torch.Tensor]:
        """Soft tokens [n_i, H] of each item (what EncoderInput holds; images only), encoded together."""
        return list(self.encode_images(torch.from_numpy(np.stack(data)).to(device)))

    def encode_images(self, pixels: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """[N, 3, S, S] -> soft tokens [N, tokens_per_image, H] in the model's dtype."""
        return self.multi_modal_projector(self.vision_tower(pixels))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled token embeddings [T, H]; an image id outside the vocabulary reads row 0 (it is
        overwritten by its soft token anyway)."""
        table = self.model.embed_tokens
        ids = input_ids.masked_fill(input_ids >= table.num_embeddings, 0)
        scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32).to(table.dtype)
        return table(ids) * scale

    # -- weights ----------------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        for prefix in ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                       "vision_tower."):
            if name.startswith(prefix):
                rest = name[len(prefix):]
                for ours, theirs in _SIGLIP_RENAMES:
                    rest = rest.replace(theirs, ours)
                return None if rest.startswith("head.") else "vision_tower." + rest
        for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
            if name.startswith(prefix):
                return "multi_modal_projector." + name[len(prefix):]
        return super().checkpoint_name(name)
