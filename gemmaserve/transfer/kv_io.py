"""Copying a transfer's KV between the paged cache and one flat byte buffer (the wire format of
plan.py): the sender gathers its pages into the buffer, the receiver scatters the buffer into the
pages its own KV manager allocated. Page geometry may differ between the two engines (page size,
V1 or V2): tokens are addressed through each side's own block tables."""

from __future__ import annotations

import torch

from ..kv.base import KVCacheManager
from .plan import TransferPlan, held_start, token_pages

KVCache = list[tuple[torch.Tensor, torch.Tensor]]   # per layer (K, V) views [pages, T, Hkv, D]


def gather(kv_cache: KVCache, kv: KVCacheManager, seq_id: str, plan: TransferPlan) -> torch.Tensor:
    """The plan's KV of a sequence as one uint8 tensor on the cache's device."""
    parts = []
    for span in plan.spans:
        pages, offsets = token_pages(kv, seq_id, span.layer, span.start, span.end)
        k, v = kv_cache[span.layer]
        pages, offsets = pages.to(k.device), offsets.to(k.device)
        for t in (k, v):
            parts.append(t[pages, offsets].reshape(-1).view(torch.uint8))
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def scatter(kv_cache: KVCache, kv: KVCacheManager, seq_id: str, plan: TransferPlan, buffer: torch.Tensor) -> None:
    """Write `buffer` (from `gather` on the sender) into the pages `seq_id` holds. Tokens below what a
    layer holds (a V1 sender sends sliding layers' out-of-window tokens to a V2 receiver) are skipped."""
    offset = 0
    for span in plan.spans:
        k, v = kv_cache[span.layer]
        row_bytes = k[0, 0].numel() * k.element_size()
        skip = max(0, held_start(kv, seq_id, span.layer) - span.start)
        pages, offsets = token_pages(kv, seq_id, span.layer, span.start + skip, span.end)
        pages, offsets = pages.to(k.device), offsets.to(k.device)
        n = span.num_tokens
        for t in (k, v):
            rows = buffer[offset + skip * row_bytes:offset + n * row_bytes].to(t.device)
            t[pages, offsets] = rows.view(t.dtype).view(n - skip, *t.shape[2:])
            offset += n * row_bytes
    if offset != buffer.numel():
        raise ValueError(f"a transfer buffer of {buffer.numel()} bytes for a plan of {offset} bytes")
