"""Reference attention in plain torch (CPU and GPU): gather K/V through page tables, then attend.

Each layer's K and V are views [pages, T, Hkv, D] (T = its tokens per page). For each batch the
backend resolves positions to (slot row, offset) once per layer group, and to pages once per group
column (one gather of `slot_pages`), so every layer of a group reuses the same plan:

* new tokens are written at (page, offset) of their layer (a scratch page is shared by all layers
  of a group: each layer overwrites it before reading it);
* decode rows (one new token each) are batched: each row's keys from the block boundary before its
  first visible key, padded to the widest row, padding masked;
* rows with several new tokens (prefill chunks) run one chunk at a time with a causal/window mask
  (where a layer asks, tokens of one image also see the image's later tokens:
  `AttentionMetadata.image_spans`), in tiles of queries that each read only the key blocks one of
  them sees (`query_tiles`).

The arithmetic is blockwise.py's: a query's result depends only on its own keys, so it is the same
bits as a decode row or inside a chunk, alone or in any batch. Only keys a query can see are
gathered (a sliding layer reads the last `window` positions, from a block boundary).
An fp8 cache (kv_quant.py) is quantised as it is written and dequantised to q's dtype as it is gathered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..kv.base import GroupTables, KVLayout
from ..kv.spec import LayerSpec
from .base import AttentionBackend, AttentionMetadata, BackendCapabilities, BatchAttention
from .blockwise import KEY_BLOCK, attend, block_span
from .kv_quant import FP8_DTYPE, dequantize, layer_scales, quantize


class GatherBuffer:
    """The reused destination of the CPU's K/V gathers. One layer's decode gather at 64 rows of ~500
    tokens is ~70 MB; allocated afresh, glibc maps such a block from the kernel and frees it back,
    so each layer of each step faults in and zeroes every page: 36 ms instead of 10 ms for that
    gather (measured), the largest cost of a 64-row eager step. One buffer serves every layer: a
    layer's gathered K/V are dead once its attention returns. (CUDA's caching allocator reuses
    blocks already, and a captured graph must not see its buffer move: CPU only.)"""

    def __init__(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape`, valid until the next `take`."""
        n = math.prod(shape) * dtype.itemsize
        if self._bytes.numel() < n:   # grow-only: steps' sizes vary, and each grow is one fresh block
            self._bytes = torch.empty(n + n // 4, dtype=torch.uint8)
        return self._bytes[:n].view(dtype).view(shape)


@dataclass(frozen=True)
class TokenRows:
    """A layer's K and V caches [pages, T, Hkv, D] seen as rows of tokens [pages * T, Hkv, D], and as
    `kv` [pages * T, 2, Hkv, D] where a token's K and V are adjacent (the shared arena): there one
    index op reads or writes both. Built once per cache (views cost a few us per call on the CPU)."""

    k: torch.Tensor
    v: torch.Tensor
    kv: torch.Tensor | None

    @classmethod
    def of(cls, k_cache: torch.Tensor, v_cache: torch.Tensor) -> "TokenRows":
        # One index op over token rows is 5x faster on the CPU than indexing by (page, offset) pairs.
        k = k_cache.view(k_cache.shape[0] * k_cache.shape[1], *k_cache.shape[2:])
        v = v_cache.view(v_cache.shape[0] * v_cache.shape[1], *v_cache.shape[2:])
        kv = None
        token = k[0].numel()
        if (k.dtype == v.dtype and k.stride() == v.stride() and k.stride(0) == 2 * token
                and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                and v.data_ptr() - k.data_ptr() == token * k.element_size()):
            kv = k.as_strided((k.shape[0], 2, *k.shape[1:]), (k.stride(0), token, *k.stride()[1:]))
        return cls(k, v, kv)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def write(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: tuple[float, float]) -> None:
        """Token rows `rows` [n] = k, v [n, Hkv, D] (quantised to fp8 with `scales` for an fp8 cache)."""
        fp8 = self.dtype == FP8_DTYPE
        if fp8:
            k, v = quantize(k, scales[0]), quantize(v, scales[1])
        elif k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        # no fp8 index_copy_ on the CPU: copy the bytes
        as_bytes = (lambda x: x.view(torch.uint8)) if fp8 else (lambda x: x)
        if self.kv is not None:
            as_bytes(self.kv).index_copy_(0, rows, as_bytes(torch.stack((k, v), 1)))
        else:
            as_bytes(self.k).index_copy_(0, rows, as_bytes(k))
            as_bytes(self.v).index_copy_(0, rows, as_bytes(v))

    def read(self, rows: torch.Tensor, shape: tuple[int, ...], scales: tuple[float, float],
             dtype: torch.dtype, into: GatherBuffer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at token rows `rows` [prod(shape)] -> two [*shape, Hkv, D] of `dtype`, gathered
        `into` the buffer when one is given (then valid until its next use)."""
        if self.kv is not None:
            out = None if into is None else into.take((rows.shape[0], *self.kv.shape[1:]), self.dtype)
            kv = torch.index_select(self.kv, 0, rows, out=out).view(*shape, *self.kv.shape[1:])
            k, v = kv.select(-3, 0), kv.select(-3, 1)
        else:
            out = [None, None] if into is None else into.take((2, rows.shape[0], *self.k.shape[1:]), self.dtype)
            k = torch.index_select(self.k, 0, rows, out=out[0]).view(*shape, *self.k.shape[1:])
            v = torch.index_select(self.v, 0, rows, out=out[1]).view(*shape, *self.v.shape[1:])
        if self.dtype == FP8_DTYPE:
            return dequantize(k, scales[0], dtype), dequantize(v, scales[1], dtype)
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))


@dataclass
class _Where:
    """Storage addresses of a set of positions [*shape]: page per group column, and offset in the page."""

    pages: torch.Tensor    # [columns, *shape]
    offsets: torch.Tensor  # [*shape]
    tokens_per_page: int
    _rows: list[torch.Tensor] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.offsets.shape)

    def rows_matrix(self) -> torch.Tensor:
        """Token rows [columns, *shape] of these positions in each column's caches."""
        return self.pages * self.tokens_per_page + self.offsets

    def rows(self, col: int) -> torch.Tensor:
        """Token rows [prod(shape)] of these positions in column `col`'s caches (computed once for
        every column of the group)."""
        if self._rows is None:
            rows = self.rows_matrix()
            self._rows = list(rows.reshape(rows.shape[0], -1).contiguous().unbind(0))
        return self._rows[col]


def addresses(tables: GroupTables, seqs: torch.Tensor, pos: torch.Tensor) -> _Where:
    """Addresses of positions `pos` of the batch's sequences `seqs` (two int64 tensors of one shape,
    any number of sequences at once: a step's tables are a handful of tensor ops, not a loop)."""
    t = tables.group.tokens_per_page
    blocks = pos // t - torch.tensor(tables.first_block)[seqs]
    dev = tables.block_rows.device
    rows = tables.block_rows[seqs.to(dev), blocks.to(dev)]
    return _Where(tables.slot_pages[rows].long().movedim(-1, 0).cpu(), pos % t, t)


@dataclass
class _Keys:
    """Keys one attention call reads: addresses [*shape] of absolute positions from a block boundary
    (clamped into the visible span, so padding reads live keys) and which of them each query sees."""

    where: _Where
    visible: torch.Tensor    # [T, n, nk] bool


@dataclass
class _Plan:
    decode_rows: torch.Tensor | None = None   # [B] row of each decode token in q
    decode: _Keys | None = None               # T = B sequences of one query, keys [B, nk]
    # per prefill chunk: its rows [start, end), the chunk's keys [1, nk], and its query tiles
    # (q0, q1, k0, k1): queries q0:q1 of the chunk read keys k0:k1 (block-aligned) of the chunk's
    prefill: list[tuple[int, int, _Where, list[tuple[int, int, int, int, torch.Tensor]]]] = \
        field(default_factory=list)


# Queries per attention call in a prefill chunk: each tile reads only the key blocks its queries see
# (a causal tile sees none after its last query); the results do not depend on the tiling.
QUERY_BLOCK = 256


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
            q_end: torch.Tensor | None = None) -> torch.Tensor:
    """[n, K] mask: key k is visible to query q iff k < q_end (default q + 1: causal; an image
    token's is its image's end) and k > q - window."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0 if q_end is None else k_pos[None, :] < q_end[:, None]
    if window is not None:
        mask &= diff < window
    return mask


def query_tiles(mask: torch.Tensor, rows: int = QUERY_BLOCK) -> list[tuple[int, int, int, int]]:
    """A chunk's [n, K] visibility mask (K a multiple of KEY_BLOCK) in tiles of `rows` queries:
    (q0, q1, k0, k1), keys k0:k1 the key blocks any of queries q0:q1 sees."""
    tiles = []
    for q0 in range(0, mask.shape[0], rows):
        q1 = min(mask.shape[0], q0 + rows)
        seen = mask[q0:q1].any(0).nonzero()
        k0, k1 = block_span(int(seen[0]), int(seen[-1]) + 1) if len(seen) else (0, KEY_BLOCK)
        tiles.append((q0, q1, k0, k1))
    return tiles


class TorchBatchAttention(BatchAttention):
    def __init__(self, md: AttentionMetadata, kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
                 specs: list[LayerSpec], token_rows: list[TokenRows], gather: GatherBuffer | None = None):
        self.md = md
        self.kv_cache = kv_cache
        self.specs = specs
        self.token_rows = token_rows
        self.gather = gather
        self.scales = [layer_scales(specs, layer) for layer in range(len(specs))]
        self.device = kv_cache[0][0].device if kv_cache else torch.device("cpu")
        self._plans: dict[tuple[int, int | None, bool], _Plan] = {}
        self._writes: dict[int, _Where] = {}
        starts = [0]
        for n in md.query_lens:
            starts.append(starts[-1] + n)
        self._starts = starts
        ends = md.query_ends()
        self._query_ends = None if ends is None else torch.tensor(ends)

    def _to_device(self, w: _Where) -> _Where:
        return _Where(w.pages.to(self.device), w.offsets.to(self.device), w.tokens_per_page)

    def _write_plan(self, group: int) -> _Where:
        w = self._writes.get(group)
        if w is None:   # every new token, in row order
            lens, ends = self.md.query_lens, self.md.seq_lens
            seqs = torch.tensor([b for b, n in enumerate(lens) for _ in range(n)])
            pos = torch.tensor([p for n, end in zip(lens, ends) for p in range(end - n, end)])
            w = self._to_device(addresses(self.md.groups[group], seqs, pos))
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
            if n == 1 and not bidirectional:
                decode.append(b)
                continue
            first_q = seq_len - n
            q_end = self._query_ends[self._starts[b]:self._starts[b] + n] if bidirectional else None
            first_k = 0 if window is None else max(0, first_q - window + 1)
            end_k = seq_len if q_end is None else max(seq_len, int(q_end.max()))
            lo, hi = block_span(first_k, end_k)
            k_pos = torch.arange(lo, hi)
            mask = visible(torch.arange(first_q, seq_len), k_pos, window, q_end)
            tiles = [(q0, q1, k0, k1, mask[q0:q1, k0:k1].to(self.device)[None])
                     for q0, q1, k0, k1 in query_tiles(mask)]
            where = addresses(tables, torch.full_like(k_pos, b), k_pos.clamp(first_k, end_k - 1))
            plan.prefill.append((self._starts[b], self._starts[b] + n, self._to_device(where), tiles))
        if decode:   # all at once: keys [B, nk] from each row's first block, padded to the widest
            seqs = torch.tensor(decode)
            ends = torch.tensor(md.seq_lens)[seqs]
            first = torch.zeros_like(ends) if window is None else (ends - window).clamp(min=0)
            lo = first // KEY_BLOCK * KEY_BLOCK
            width = int(((ends - lo + KEY_BLOCK - 1) // KEY_BLOCK).max()) * KEY_BLOCK
            k_pos = lo[:, None] + torch.arange(width)[None, :]
            seen = (k_pos >= first[:, None]) & (k_pos < ends[:, None])
            pos = torch.minimum(torch.maximum(k_pos, first[:, None]), ends[:, None] - 1)
            plan.decode_rows = torch.tensor([self._starts[b] for b in decode], device=self.device)
            plan.decode = _Keys(self._to_device(addresses(tables, seqs[:, None].expand_as(pos), pos)),
                                seen[:, None, :].to(self.device))
        self._plans[(group, window, bidirectional)] = plan
        return plan

    def last_tokens(self, seqs):
        return TorchBatchAttention(self.md.last_tokens(seqs), self.kv_cache, self.specs, self.token_rows,
                                   self.gather)

    def __call__(self, layer, q, k, v, *, scale, window, softcap=None, bidirectional=False):
        if softcap is not None:
            raise NotImplementedError("attention soft-capping is not used by Gemma 3/4 text models")
        # Every line here runs once per layer and step: an eager decode step at batch 1 spends more
        # time in this method than in its attention arithmetic.
        group, col = self.md.layer_slot[layer]
        cache, scales = self.token_rows[layer], self.scales[layer]
        if k is not None and self.specs[layer].owns_kv:   # k None: a reader of this layer's KV (MTP drafter)
            cache.write(self._write_plan(group).rows(col), k, v, scales)
        plan = self._plan(group, window, bidirectional)
        if plan.decode is not None:
            keys = plan.decode
            kk, vv = cache.read(keys.where.rows(col), keys.where.shape, scales, q.dtype, self.gather)
            o = attend(q[plan.decode_rows].unsqueeze(1), kk, vv, keys.visible, scale).squeeze(1)
            if not plan.prefill and len(plan.decode_rows) == q.shape[0]:   # every row a decode row, in order
                return o
        out = torch.empty_like(q)
        if plan.decode is not None:
            out[plan.decode_rows] = o
        for start, _, where, tiles in plan.prefill:   # (the decode rows' keys are dead: the buffer is free)
            kk, vv = cache.read(where.rows(col), (1, *where.shape), scales, q.dtype, self.gather)
            for q0, q1, k0, k1, mask in tiles:
                out[start + q0:start + q1] = attend(q[start + q0:start + q1][None], kk[:, k0:k1], vv[:, k0:k1],
                                                    mask, scale)[0]
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
        self._rows_of: tuple[list, list[TokenRows]] | None = None   # (kv_cache, its token rows)
        self._gather = GatherBuffer()

    def allocate_kv_cache(self, specs, layout: KVLayout, device):
        self._specs = list(specs)
        return allocate_paged_kv(specs, layout, device)

    def _token_rows(self, kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> list[TokenRows]:
        if self._rows_of is None or self._rows_of[0] is not kv_cache:
            self._rows_of = (kv_cache, [TokenRows.of(k, v) for k, v in kv_cache])
        return self._rows_of[1]

    def begin_batch(self, metadata, kv_cache):
        cpu = bool(kv_cache) and kv_cache[0][0].device.type == "cpu"
        return TorchBatchAttention(metadata, kv_cache, self._specs, self._token_rows(kv_cache),
                                   self._gather if cpu else None)
