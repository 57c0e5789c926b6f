"""KV layer specs of public Gemma 3 / Gemma 4 checkpoints, from the model code itself: each shape is a
real config (testing/synthetic.py) and its specs are what our model derives from that config (window,
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


def parse_shapes_and_lengths(shapes_text: str, lengths_text: str) -> tuple[list[str], list[int]]:
    """--shapes (names in SHAPES) and --lengths (token counts), comma-separated."""
    from ..errors import UserInputError

    shapes = [s.strip() for s in shapes_text.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        raise UserInputError(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    try:
        lengths = [int(x) for x in lengths_text.split(",") if x.strip()]
    except ValueError:
        raise UserInputError(f"--lengths must be comma-separated integers, got {lengths_text!r}") from None
    if not lengths or min(lengths) < 1:
        raise UserInputError("--lengths must be positive")
    return shapes, lengths
