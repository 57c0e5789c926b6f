"""A transfer's KV as token rows (the wire format of plan.py), between the wire and the paged cache.

The scheduler side says where each token of each layer span lives (`row_spans`, from the KV manager's
block tables: page geometry may differ between the two engines, page size or V1 / V2); the runner copies
(`gather_rows` after the forward that computed them, `scatter_rows` before the forward that reads them),
as the step description says (kv/connector.py `StagedRows`), so it stays the only writer of its cache.

Under tensor parallelism each rank holds a share of a layer's KV heads (models/tensor_parallel.py says
which: the caller passes each rank's first head): it gathers its own heads' rows, and rank 0 puts the
wire's rows together from every rank's (`assemble`); a receiving rank takes its own heads out of the
wire's rows. The wire always carries every head, so the
two engines need not have the same number of ranks.

    wire, one span (rows n, heads H):   K [n, H, D] | V [n, H, D]
    rank r of 2, H = 4:                 K [n, 2, D] (heads 2r, 2r + 1) | V ...
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..kv.base import KVCacheManager
from ..kv.connector import RowSpan
from .plan import TransferPlan

KVCache = list[tuple[torch.Tensor, torch.Tensor]]   # per layer (K, V) views [pages, T, Hkv, D]


# -- the scheduler side: where the rows are -------------------------------------------------------------
def row_spans(kv: KVCacheManager, seq_id: str, plan: TransferPlan, heads: list[int],
              receiving: bool = False) -> list[RowSpan]:
    """Each span of `plan` as the places of its tokens in `seq_id`'s pages. `heads`: every layer's KV heads in
    the model. `receiving`: tokens below what a layer holds here are skipped (a V1 sender sends sliding layers'
    out-of-window tokens to a V2 receiver)."""
    out = []
    for span in plan.spans:
        skip = max(0, held_start(kv, seq_id, span.layer) - span.start) if receiving else 0
        pages, offsets = token_pages(kv, seq_id, span.layer, span.start + skip, span.end)
        out.append(RowSpan(span.layer, pages.tolist(), offsets.tolist(), heads[span.layer], span.num_tokens, skip))
    return out


def wire_bytes(spans: list[RowSpan], row_bytes: list[int]) -> int:
    """Bytes of the wire buffer for `spans`; `row_bytes`: per layer, one head's K (or V) row in bytes."""
    return sum(2 * s.rows * s.heads * row_bytes[s.layer] for s in spans)


def token_pages(kv: KVCacheManager, seq_id: str, layer: int, start: int, end: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset in page) of tokens [start, end) of a sequence in one layer, from its block tables."""
    group, column = kv.layer_slot[layer]
    t = kv.groups[group].tokens_per_page
    first, rows = kv.block_table(seq_id, group)
    pos = np.arange(start, end)
    slot_rows = np.asarray(rows, dtype=np.int64)[pos // t - first]
    if kv.layout.identity_slots:
        pages = slot_rows
    else:
        wanted = sorted(set(slot_rows.tolist()))
        got, table = kv.slot_rows(group, wanted)
        page_of = {r: p[column] for r, p in zip(got, table)}
        pages = np.fromiter((page_of[r] for r in slot_rows.tolist()), dtype=np.int64, count=len(slot_rows))
    return torch.from_numpy(pages), torch.from_numpy(pos % t)


def held_start(kv: KVCacheManager, seq_id: str, layer: int) -> int:
    """The first token of a sequence a layer holds pages for."""
    group, _ = kv.layer_slot[layer]
    first, _ = kv.block_table(seq_id, group)
    return first * kv.groups[group].tokens_per_page


# -- the runner side: copying ---------------------------------------------------------------------------
def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[..., H, D] of any dtype -> [..., H, D * element size] uint8 (a copy where not contiguous)."""
    return t.contiguous().view(torch.uint8)


def gather_rows(kv_cache: KVCache, spans: list[RowSpan]) -> torch.Tensor:
    """This rank's heads of every span's rows, K then V per span, as one uint8 tensor on the cache's device."""
    parts = []
    for span in spans:
        k, v = kv_cache[span.layer]
        pages = torch.tensor(span.pages, dtype=torch.long, device=k.device)
        offsets = torch.tensor(span.offsets, dtype=torch.long, device=k.device)
        for t in (k, v):
            parts.append(_as_bytes(t[pages, offsets]).reshape(-1))
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def assemble(parts: list[torch.Tensor], spans: list[RowSpan], kv_cache: KVCache,
             first_head: Callable[[int, int], int]) -> torch.Tensor:
    """The wire buffer from every rank's `gather_rows` (in rank order): each head's rows from a rank that holds
    it. `first_head(heads, rank)`: the first of a layer's `heads` KV heads that `rank` holds."""
    world = len(parts)
    out, offset = [], 0
    for span in spans:
        k, _ = kv_cache[span.layer]
        local, row = k.shape[2], k.shape[3] * k.element_size()
        size = span.rows * local * row
        firsts = [first_head(span.heads, r) for r in range(world)]
        owners = []   # per model head: (rank, its index there)
        for h in range(span.heads):
            r = next(r for r in range(world) if 0 <= h - firsts[r] < local)
            owners.append((r, h - firsts[r]))
        for _ in range(2):   # K, then V
            views = [p[offset:offset + size].view(span.rows, local, row) for p in parts]
            out.append(torch.stack([views[r][:, j] for r, j in owners], dim=1).reshape(-1))
            offset += size
    return torch.cat(out) if out else torch.empty(0, dtype=torch.uint8)


def scatter_rows(kv_cache: KVCache, spans: list[RowSpan], wire: torch.Tensor,
                 first_head: Callable[[int], int] = lambda heads: 0) -> None:
    """Write this rank's heads of the wire's rows into the cache (skipping each span's first `skip` rows).
    `first_head(heads)`: the first of a layer's `heads` KV heads this rank holds."""
    offset = 0
    for span in spans:
        k, v = kv_cache[span.layer]
        local, row = k.shape[2], k.shape[3] * k.element_size()
        first = first_head(span.heads)
        if first + local > span.heads:
            raise ValueError(f"layer {span.layer}: heads {first}..{first + local - 1} here, {span.heads} sent")
        size = span.rows * span.heads * row
        pages = torch.tensor(span.pages, dtype=torch.long, device=k.device)
        offsets = torch.tensor(span.offsets, dtype=torch.long, device=k.device)
        for t in (k, v):
            rows = wire[offset:offset + size].view(span.rows, span.heads, row)[span.skip:, first:first + local]
            t[pages, offsets] = rows.to(t.device).contiguous().view(t.dtype).view(span.rows - span.skip, local, -1)
            offset += size
    if offset != wire.numel():
        raise ValueError(f"a transfer buffer of {wire.numel()} bytes for spans of {offset} bytes")
