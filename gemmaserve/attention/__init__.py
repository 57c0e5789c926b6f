"""Attention backends behind one interface; `select_backend` resolves "auto" and checks fit."""

from __future__ import annotations

import torch

from ..errors import UserInputError
from ..kv.spec import LayerSpec
from .base import AttentionBackend, AttentionMetadata, BackendCapabilities, BatchAttention
from .torch_backend import TorchAttentionBackend

def _triton_backend() -> type:
    from .triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


BACKENDS = {"torch": lambda: TorchAttentionBackend, "triton": _triton_backend}


def select_backend(name: str, device: torch.device, specs: list[LayerSpec]) -> AttentionBackend:
    """"auto": our Triton kernels on CUDA (when Triton is installed), the torch reference elsewhere."""
    from .triton_backend import triton_available

    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available(device) is None else "torch"
    if name not in BACKENDS:
        raise UserInputError(f"unknown attention backend {name!r}; available: auto, {', '.join(BACKENDS)}")
    if name == "triton":
        why = triton_available(device)
        if why is not None:
            raise UserInputError(f"attention backend 'triton' is not available: {why}")
    cls = BACKENDS[name]()
    caps = cls.capabilities
    if device.type not in caps.devices:
        raise UserInputError(f"attention backend {name!r} does not run on {device.type}")
    if caps.head_dims is not None:
        bad = sorted({s.head_dim for s in specs} - caps.head_dims)
        if bad:
            raise UserInputError(f"attention backend {name!r} does not support head_dim {bad}")
    return cls()


__all__ = ["AttentionBackend", "AttentionMetadata", "BackendCapabilities", "BatchAttention", "select_backend"]
