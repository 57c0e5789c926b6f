"""KV layer specs of public Gemma 3 / Gemma 4 checkpoints, from the model code itself: each shape is a
real config (bench/synthetic.py) and its specs are what our model derives from that config (window,
KV heads and head dim per layer, KV-shared layers), so the memory benchmark and the KV tests measure
exactly the geometry the engine serves."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.spec import LayerSpec
from .synthetic import GEMMA3_CONFIGS, GEMMA4_CONFIGS, model_config


@dataclass(frozen=True)
class ModelShape:
    name: str

    @property
    def config(self):
        return model_config(self.name)

    @property
    def window(self) -> int:
        return self.config.sliding_window

    def layer_specs(self, dtype: torch.dtype = torch.bfloat16) -> list[LayerSpec]:
        return self.config.kv_layer_specs(dtype)


SHAPES = {name: ModelShape(name) for name in (*GEMMA3_CONFIGS, *GEMMA4_CONFIGS)}
