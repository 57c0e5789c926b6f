"""KV cache managers. `create_kv_manager` sizes the page pool from the memory budget."""

from __future__ import annotations

from ..errors import UserInputError
from .base import KVCacheManager, KVStats
from .manager_v1 import KVCacheManagerV1
from .spec import AttentionKind, LayerSpec


def create_kv_manager(name: str, specs: list[LayerSpec], page_size: int, budget_bytes: int) -> KVCacheManager:
    if name in ("auto", "v1"):
        cls = KVCacheManagerV1
    else:
        raise UserInputError(f"unknown KV cache manager {name!r} (available: auto, v1)")
    page_bytes = cls.page_bytes_for(specs, page_size)
    num_pages = budget_bytes // page_bytes
    if num_pages < 1:
        raise UserInputError(f"KV cache budget of {budget_bytes} bytes is smaller than one page "
                             f"({page_bytes} bytes for {page_size} tokens over all layers)")
    return cls(specs, page_size, num_pages)


__all__ = ["AttentionKind", "KVCacheManager", "KVCacheManagerV1", "KVStats", "LayerSpec", "create_kv_manager"]
