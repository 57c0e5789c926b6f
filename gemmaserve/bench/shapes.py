"""Attention shapes of public Gemma 3 / Gemma 4 checkpoints (from their config.json, see
../shared/reference/gemma-architecture.md §7), as KV layer specs. Used by the memory benchmark and the
KV tests; the engine itself derives specs from the loaded model's config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.spec import AttentionKind, LayerSpec


@dataclass(frozen=True)
class AttentionShape:
    name: str
    num_layers: int
    full_every: int              # layer i is full iff (i + 1) % full_every == 0
    window: int
    sliding_kv_heads: int
    sliding_head_dim: int
    full_kv_heads: int
    full_head_dim: int
    num_kv_shared_layers: int = 0   # Gemma 4 E-models: the last N layers read an earlier layer's KV

    def layer_specs(self, dtype: torch.dtype = torch.bfloat16) -> list[LayerSpec]:
        full = [(i + 1) % self.full_every == 0 for i in range(self.num_layers)]
        first_shared = self.num_layers - self.num_kv_shared_layers
        specs: list[LayerSpec] = []
        for i, is_full in enumerate(full):
            source = None
            if i >= first_shared:  # the last non-shared layer of the same kind
                source = max(j for j in range(first_shared) if full[j] == is_full)
            if is_full:
                specs.append(LayerSpec(AttentionKind.FULL, self.full_kv_heads, self.full_head_dim, dtype,
                                       kv_source=source))
            else:
                specs.append(LayerSpec(AttentionKind.SLIDING, self.sliding_kv_heads, self.sliding_head_dim, dtype,
                                       window=self.window, kv_source=source))
        return specs


SHAPES = {s.name: s for s in (
    AttentionShape("gemma3-1b", 26, 6, 512, 1, 256, 1, 256),
    AttentionShape("gemma3-4b", 34, 6, 1024, 4, 256, 4, 256),
    AttentionShape("gemma3-27b", 62, 6, 1024, 16, 128, 16, 128),
    AttentionShape("gemma4-e2b", 35, 5, 512, 1, 256, 1, 512, num_kv_shared_layers=20),
    AttentionShape("gemma4-31b", 60, 6, 1024, 16, 256, 4, 512),
)}
