"""What the KV cache needs to know about each attention layer of a model, and nothing more."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class AttentionKind(enum.Enum):
    FULL = "full"        # sees every earlier token
    SLIDING = "sliding"  # sees the last `window` tokens, itself included


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer as the KV cache sees it.

    `kv_source` names the layer whose K/V this layer reads when it owns none (Gemma 4's KV-shared
    tail layers); None means the layer stores its own.

    `dtype` is the KV storage dtype. An fp8 layer stores fp8(K / k_scale) and fp8(V / v_scale) and
    reads them back times the scale (engine/kv_calibration.py sets the scales; other dtypes ignore
    them). A KV-sharing layer reads with its source's scales.
    """

    kind: AttentionKind
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    window: int | None = None
    kv_source: int | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if (self.kind is AttentionKind.SLIDING) != (self.window is not None):
            raise ValueError("a sliding layer needs a window and a full layer must not have one")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not (self.k_scale > 0 and self.v_scale > 0):
            raise ValueError(f"KV scales must be positive, got {self.k_scale}, {self.v_scale}")

    @property
    def owns_kv(self) -> bool:
        return self.kv_source is None

    @property
    def fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    def bytes_per_token(self) -> int:
        """K and V of one token in this layer (0 if the layer reads another layer's KV)."""
        if not self.owns_kv:
            return 0
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
