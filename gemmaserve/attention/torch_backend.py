"""Reference attention in plain torch (CPU and GPU): gather K/V through page tables, then SDPA.

Each layer's K and V are views [pages, T, Hkv, D] (T = its tokens per page). For each batch the
backend resolves positions to (slot row, offset) once per layer group, and to pages once per group
column (one gather of `slot_pages`), so every layer of a group reuses the same plan:

* new tokens are written at (page, offset) of their layer (a scratch page is shared by all layers
  of a group: each layer overwrites it before reading it);
* decode rows (one new token each) are batched: keys padded to the longest row, padding masked;
* rows with several new tokens (prefill chunks) run one by one with a causal/window mask (where a
  layer asks, tokens of one image also see the image's later tokens: `AttentionMetadata.image_spans`).

Only keys a query can see are gathered: a sliding layer reads the last `window` positions.
An fp8 cache (kv_quant.py) is quantised as it is written and dequantised to q's dtype as it is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kv.base import GroupTables, KVLayout
from ..kv.spec import LayerSpec
from .base import AttentionBackend, AttentionMetadata, BackendCapabilities, BatchAttention
from .kv_quant import FP8_DTYPE, dequantize, layer_scales, quantize


@dataclass
class _Where:
    """Storage addresses of a set of positions: page per group column, and offset in the page."""

    pages: torch.Tensor    # [columns, *shape]
    offsets: torch.Tensor  # [*shape]
    _rows: torch.Tensor | None = None

    def rows(self, cache: torch.Tensor, col: int) -> torch.Tensor:
        """Row numbers of these positions of column `col` in `cache` [pages, T, ...] seen as rows of
        tokens (computed once for every layer of the group)."""
        if self._rows is None:
            self._rows = self.pages * cache.shape[1] + self.offsets
        return self._rows[col]

    def gather(self, cache: torch.Tensor, col: int) -> torch.Tensor:
        """cache [pages, T, ...] at these positions of column `col` -> [*shape, ...]. One
        index_select over the cache seen as rows of tokens: 5x faster on the CPU than indexing by
        (page, offset) pairs, which computes the same row numbers element by element."""
        rows = self.rows(cache, col)
        return _token_rows(cache).index_select(0, rows.reshape(-1)).view(*rows.shape, *cache.shape[2:])

    def write(self, cache: torch.Tensor, col: int, x: torch.Tensor) -> None:
        """cache at these positions of column `col` = x [n, ...] (one index_copy_, like `gather`)."""
        if cache.dtype == FP8_DTYPE:   # no fp8 index_copy_ on the CPU: copy the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        _token_rows(cache).index_copy_(0, self.rows(cache, col), x)


def _token_rows(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])


@dataclass
class _Plan:
    decode_rows: torch.Tensor | None = None   # [B] row of each decode token in q
    decode_keys: _Where | None = None         # [B, K] (padding repeats a valid key)
    decode_mask: torch.Tensor | None = None   # [B, 1, 1, K] True = visible; None if no padding
    prefill: list[tuple[int, int, _Where, torch.Tensor]] = field(default_factory=list)  # start, end, keys, mask


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
            q_end: torch.Tensor | None = None) -> torch.Tensor:
    """[n, K] mask: key k is visible to query q iff k < q_end (default q + 1: causal; an image
    token's is its image's end) and k > q - window."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0 if q_end is None else k_pos[None, :] < q_end[:, None]
    if window is not None:
        mask &= diff < window
    return mask


class TorchBatchAttention(BatchAttention):
    def __init__(self, md: AttentionMetadata, kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
                 specs: list[LayerSpec]):
        self.md = md
        self.kv_cache = kv_cache
        self.specs = specs
        self.device = kv_cache[0][0].device if kv_cache else torch.device("cpu")
        self._plans: dict[tuple[int, int | None, bool], _Plan] = {}
        self._writes: dict[int, _Where] = {}
        starts = [0]
        for n in md.query_lens:
            starts.append(starts[-1] + n)
        self._starts = starts
        ends = md.query_ends()
        self._query_ends = None if ends is None else torch.tensor(ends)

    def _where(self, tables: GroupTables, seqs: torch.Tensor, pos: torch.Tensor) -> _Where:
        """Addresses of positions `pos` of the batch's sequences `seqs` (two int64 tensors of one shape,
        any number of sequences at once: a step's tables are a handful of tensor ops, not a loop)."""
        t = tables.group.tokens_per_page
        blocks = pos // t - torch.tensor(tables.first_block)[seqs]
        dev = tables.block_rows.device
        rows = tables.block_rows[seqs.to(dev), blocks.to(dev)]
        return _Where(tables.slot_pages[rows].long().movedim(-1, 0).cpu(), pos % t)

    def _to_device(self, w: _Where) -> _Where:
        return _Where(w.pages.to(self.device), w.offsets.to(self.device))

    def _write_plan(self, group: int) -> _Where:
        w = self._writes.get(group)
        if w is None:   # every new token, in row order
            lens = torch.tensor(self.md.query_lens)
            seqs = torch.repeat_interleave(torch.arange(len(lens)), lens)
            pos = torch.tensor(self.md.seq_lens)[seqs] - lens[seqs] + (torch.arange(len(seqs)) - torch.tensor(
                self._starts[:-1])[seqs])
            w = self._to_device(self._where(self.md.groups[group], seqs, pos))
            self._writes[group] = w
        return w

    def _plan(self, group: int, window: int | None, bidirectional: bool) -> _Plan:
        bidirectional = bidirectional and self._query_ends is not None
        plan = self._plans.get((group, window, bidirectional))
        if plan is not None:
            return plan
        plan = _Plan()
        md, tables = self.md, self.md.groups[group]
        decode = []   # sequences with one new token
        for b, (n, seq_len) in enumerate(zip(md.query_lens, md.seq_lens)):
            if n == 1:
                decode.append(b)
                continue
            first_q = seq_len - n
            first_k = 0 if window is None else max(0, first_q - window + 1)
            k_pos = torch.arange(first_k, seq_len)
            q_end = self._query_ends[self._starts[b]:self._starts[b] + n] if bidirectional else None
            mask = visible(torch.arange(first_q, seq_len), k_pos, window, q_end)
            plan.prefill.append((self._starts[b], self._starts[b] + n,
                                 self._to_device(self._where(tables, torch.full_like(k_pos, b), k_pos)),
                                 mask.to(self.device)))
        if decode:   # all at once: keys [B, K], each row padded by repeating its last key (masked)
            seqs = torch.tensor(decode)
            ends = torch.tensor(md.seq_lens)[seqs]
            first = torch.zeros_like(ends) if window is None else (ends - window).clamp(min=0)
            lens = ends - first
            width = int(lens.max())
            pos = first[:, None] + torch.minimum(torch.arange(width)[None, :], lens[:, None] - 1)
            plan.decode_rows = torch.tensor([self._starts[b] for b in decode], device=self.device)
            plan.decode_keys = self._to_device(self._where(tables, seqs[:, None].expand_as(pos), pos))
            if int(lens.min()) != width:
                mask = torch.arange(width)[None, :] < lens[:, None]
                plan.decode_mask = mask[:, None, None, :].to(self.device)
        self._plans[(group, window, bidirectional)] = plan
        return plan

    @staticmethod
    def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                gqa: bool) -> torch.Tensor:
        """q [B, Hq, D] (one token per row), k/v [B, K, Hkv, D] -> [B, Hq, D]."""
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           scale=scale, enable_gqa=gqa)
        return o.squeeze(2)

    def last_tokens(self, seqs):
        return TorchBatchAttention(self.md.last_tokens(seqs), self.kv_cache, self.specs)

    def __call__(self, layer, q, k, v, *, scale, window, softcap=None, bidirectional=False):
        if softcap is not None:
            raise NotImplementedError("attention soft-capping is not used by Gemma 3/4 text models")
        group, col = self.md.layer_slot[layer]
        k_cache, v_cache = self.kv_cache[layer]
        fp8 = k_cache.dtype == FP8_DTYPE
        k_scale, v_scale = layer_scales(self.specs, layer)
        if self.specs[layer].owns_kv:
            w = self._write_plan(group)
            w.write(k_cache, col, quantize(k, k_scale) if fp8 else k.to(k_cache.dtype))
            w.write(v_cache, col, quantize(v, v_scale) if fp8 else v.to(v_cache.dtype))

        def gather(cache: torch.Tensor, keys: _Where, kv_scale: float) -> torch.Tensor:
            x = keys.gather(cache, col)
            return dequantize(x, kv_scale, q.dtype) if fp8 else x.to(q.dtype)   # no-op for "auto"

        plan = self._plan(group, window, bidirectional)
        gqa = q.shape[1] != k_cache.shape[2]
        if plan.decode_rows is not None and not plan.prefill:   # every row a decode row, in order
            return self._decode(q, gather(k_cache, plan.decode_keys, k_scale), gather(v_cache, plan.decode_keys, v_scale),
                                plan.decode_mask, scale, gqa)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(q[plan.decode_rows], gather(k_cache, plan.decode_keys, k_scale),
                                                 gather(v_cache, plan.decode_keys, v_scale), plan.decode_mask, scale, gqa)
        for start, end, keys, mask in plan.prefill:
            kk = gather(k_cache, keys, k_scale).transpose(0, 1).unsqueeze(0)   # [1, Hkv, K, D]
            vv = gather(v_cache, keys, v_scale).transpose(0, 1).unsqueeze(0)
            qq = q[start:end].transpose(0, 1).unsqueeze(0)                     # [1, Hq, n, D]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[start:end] = o[0].transpose(0, 1)
        return out


def allocate_paged_kv(specs: list[LayerSpec], layout: KVLayout,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) views [pages, T, Hkv, D]: one tensor per layer (V1), or views into one byte
    arena where page p of every layer starts at byte p * page_bytes (V2)."""
    caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    # empty, not zeros: untouched pages cost no RAM on the CPU until first written.
    arena = torch.empty(layout.num_pages * layout.page_bytes, dtype=torch.uint8, device=device) \
        if layout.shared_arena else None
    for i, spec in enumerate(specs):
        if not spec.owns_kv:
            caches.append(caches[spec.kv_source])
            continue
        t, h, d = layout.tokens_per_page[i], spec.num_kv_heads, spec.head_dim
        if arena is None:
            shape = (layout.num_pages, t, h, d)
            caches.append((torch.empty(shape, dtype=spec.dtype, device=device),
                           torch.empty(shape, dtype=spec.dtype, device=device)))
            continue
        # Page p of this layer: T tokens x (K, V) x Hkv x D at byte p * page_bytes of the arena.
        page_elems = layout.page_bytes // torch.empty((), dtype=spec.dtype).element_size()
        kv = arena.view(spec.dtype).as_strided((layout.num_pages, t, 2, h, d), (page_elems, 2 * h * d, h * d, d, 1))
        caches.append((kv[:, :, 0], kv[:, :, 1]))
    return caches


class TorchAttentionBackend(AttentionBackend):
    capabilities = BackendCapabilities(name="torch", devices=frozenset({"cpu", "cuda"}), head_dims=None,
                                       scratch_pages=True, shared_arena=True)

    def __init__(self) -> None:
        self._specs: list[LayerSpec] = []

    def allocate_kv_cache(self, specs, layout: KVLayout, device):
        self._specs = list(specs)
        return allocate_paged_kv(specs, layout, device)

    def begin_batch(self, metadata, kv_cache):
        return TorchBatchAttention(metadata, kv_cache, self._specs)
