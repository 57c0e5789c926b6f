"""FP8 (e4m3) KV storage: what "stored = fp8(x / scale), read = fp8 * scale" means in torch.

Values beyond the e4m3 range saturate at +-448 (casting them would give NaN on some devices). The
torch backend uses these directly; the Triton kernels do the same arithmetic inline (store: divide,
clamp, cast; attention: the K scale folds into the softmax scale, the V scale into the output).
"""

from __future__ import annotations

import torch

from ..kv.spec import LayerSpec

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0   # largest finite e4m3fn value


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as e4m3, saturated (computed in fp32 so bf16 inputs round once)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype) if scale != 1.0 else x.to(dtype)


def layer_scales(specs: list[LayerSpec], layer: int) -> tuple[float, float]:
    """(k_scale, v_scale) of the storage `layer` reads (its KV source's for a KV-sharing layer)."""
    spec = specs[layer]
    owner = spec if spec.owns_kv else specs[spec.kv_source]
    return owner.k_scale, owner.v_scale
