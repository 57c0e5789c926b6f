"""KV cache managers. `create_kv_manager` sizes the page pool from the memory budget."""

from __future__ import annotations

from ..units import format_bytes
from ..errors import UserInputError
from .base import GroupTables, KVCacheManager, KVLayout, KVStats
from .groups import derive_groups
from .manager_v1 import KVCacheManagerV1
from .manager_v2 import KVCacheManagerV2
from .pinned_split import PinnedSplitKVManager
from .spec import AttentionKind, LayerSpec


def page_bytes_for(manager: str, specs: list[LayerSpec], page_size: int) -> int:
    if manager == "v1":
        return KVCacheManagerV1.page_bytes_for(specs, page_size)
    return derive_groups(specs, page_size).page_bytes


def create_kv_manager(manager: str, specs: list[LayerSpec], page_size: int, budget_bytes: int, *,
                      enable_prefix_caching: bool = False, enable_scratch: bool = False,
                      sliding_share: float | None = None, lookback: int = 0, offload_bytes: int = 0) -> KVCacheManager:
    """A manager whose pool fits in `budget_bytes`. Fails if the budget cannot hold even one token.
    `sliding_share` pins V2's pool split between sliding and full groups (benchmarks only). `lookback`:
    keys behind a sequence's next query that sliding groups keep too (V2; V1 keeps every key).
    `offload_bytes`: a host-memory tier of that size behind the prefix cache (V2 with prefix caching)."""
    page_bytes = page_bytes_for(manager, specs, page_size)
    num_pages = budget_bytes // page_bytes
    if manager == "v1":
        minimum = 1
    else:
        minimum = sum(g.num_layers for g in derive_groups(specs, page_size).groups)
    if num_pages < minimum:
        raise UserInputError(
            f"KV cache budget of {format_bytes(budget_bytes)} is too small for this model: one token in every layer "
            f"needs {minimum} pages of {format_bytes(page_bytes)} ({format_bytes(minimum * page_bytes)}); "
            "raise --kv-cache-memory or lower --page-size")
    if manager == "v1":
        if sliding_share is not None:
            raise UserInputError("a pinned pool split needs KV cache manager v2")
        return KVCacheManagerV1(specs, page_size, num_pages)
    if manager == "v2" and sliding_share is not None:
        if enable_prefix_caching:
            raise UserInputError("a pinned pool split is a benchmark knob that needs prefix caching off")
        return PinnedSplitKVManager(specs, page_size, num_pages, sliding_share=sliding_share,
                                    enable_scratch=enable_scratch, lookback=lookback)
    if offload_bytes and (manager != "v2" or sliding_share is not None or not enable_prefix_caching):
        raise UserInputError("--kv-offload-memory keeps what the prefix cache evicts: it needs KV cache manager v2 "
                             "with prefix caching on")
    if manager == "v2":
        offload_pages = offload_bytes // page_bytes
        largest = max(g.num_layers for g in derive_groups(specs, page_size).groups)
        if offload_bytes and offload_pages < largest:
            raise UserInputError(
                f"--kv-offload-memory {format_bytes(offload_bytes)} cannot hold one block: a block of the largest "
                f"layer group takes {largest} pages of {format_bytes(page_bytes)} ({format_bytes(largest * page_bytes)})")
        return KVCacheManagerV2(specs, page_size, num_pages, enable_prefix_caching=enable_prefix_caching,
                                enable_scratch=enable_scratch, lookback=lookback, offload_pages=offload_pages)
    raise UserInputError(f"unknown KV cache manager {manager!r} (v1 or v2)")


__all__ = ["AttentionKind", "GroupTables", "KVCacheManager", "KVCacheManagerV1", "KVCacheManagerV2", "KVLayout",
           "KVStats", "LayerSpec", "create_kv_manager", "page_bytes_for"]
