"""Decode attention that a compiled graph traces: the KV cache and the step's addresses as tensor inputs.

Called through an opaque op (attention/handle.py), a compiled CPU decode step spends ~200 us a layer
in Python, dispatch and cold caches between the matrix products, around ~10 us of arithmetic. Where
every layer's K/V lives in one arena with one geometry (KV manager V2: page p of every layer is the
same bytes, layers differ only in which pages they use), the whole cache is one tensor of token
rows [pages * T, 2, Hkv, D] and the graph reads it like any other input:

    runner   tables = DecodeTables.build(...)     per attention kind, the rows of each row's keys in
                                                  blocks [cols, B, nb, KEY_BLOCK], and what each key is
                                                  (`state`: masked, seen, the new token); write rows
    graph    per layer: old = kv[rows of its column], the new token's k/v in its place; attend
             -> logits, and every owning layer's new k/v [layers, B, 2, Hkv, D]
    runner   kv[write rows] = new k/v             (one index_copy_ for every layer)

The graph writes nothing: a new token's K/V joins its own row's keys inside the graph (and the later
rows' of its sequence, where a verification step runs as one row per token: `state` NEW + d) and reaches
the cache after it, so there is no side effect to order and no input to mutate. A row's keys start at the
block boundary before its first visible key, as the eager backend's do, and go through the same
blockwise arithmetic (blockwise.py): the same bits as an eager step. Keys a row must not see (before
its window in its first block, padding up to the batch's widest row, rows that pad the batch) read the
null page's first row (zeroed: finite, as masked values must be), and their state masks them. The
graph holds no address of its own (the arena's size, hence the null page, is the engine's choice):
one graph serves any KV pool. Each kind's block count nb is a dynamic dimension of the graph (one
graph for every context length), at least 2: torch.compile specialises sizes 0 and 1, so shorter
tables are padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..kv.spec import LayerSpec
from .base import AttentionMetadata, BatchAttention
from .blockwise import KEY_BLOCK, NEW, SEEN, attend_paged
from .kv_quant import FP8_DTYPE
from .torch_backend import TokenRows

MIN_WIDTH = 2   # key blocks


@dataclass(frozen=True)
class DecodeLayout:
    """What stays fixed across steps: the arena's token rows and each layer's place in the tables."""

    kv: torch.Tensor                            # [pages * T, 2, Hkv, D], every layer's view of the arena
    tokens_per_page: int
    null_row: int                               # first row of the null page (masked keys read it)
    kinds: tuple[tuple[int, int | None], ...]   # (group, window) of each attention kind, in first-use order
    slot: tuple[tuple[int, int], ...]           # per layer: (kind, column of its group)
    owners: tuple[int, ...]                     # layers that store K/V, in layer order
    source: tuple[int, ...]                     # per layer: the layer whose K/V it reads (itself if it owns)

    @classmethod
    def of(cls, specs: list[LayerSpec], kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
           layer_slot: tuple[tuple[int, int], ...], tokens_per_page: tuple[int, ...],
           null_page: int) -> "DecodeLayout | str":
        """The layout, or why this cache cannot be read as one tensor (the step then attends through
        the opaque op). Zeroes the null page's first row, which masked keys read."""
        if not kv_cache:
            return "the model has no attention layers"
        rows = [TokenRows.of(k, v) for k, v in kv_cache]
        first = rows[0].kv
        if first is None:
            return "K/V are not one arena (KV manager V1)"
        if first.dtype == FP8_DTYPE:
            return "an fp8 cache is read through the opaque op"
        same = all(r.kv is not None and r.kv.data_ptr() == first.data_ptr() and r.kv.shape == first.shape
                   and r.kv.stride() == first.stride() and r.kv.dtype == first.dtype for r in rows)
        if not same or len(set(tokens_per_page)) != 1:
            return "layers of different page geometry"
        kinds: list[tuple[int, int | None]] = []
        slot = []
        for layer, spec in enumerate(specs):
            group, col = layer_slot[layer]
            kind = (group, spec.window)
            if kind not in kinds:
                kinds.append(kind)
            slot.append((kinds.index(kind), col))
        owners = tuple(i for i, s in enumerate(specs) if s.owns_kv)
        source = tuple(i if s.owns_kv else s.kv_source for i, s in enumerate(specs))
        t = tokens_per_page[0]
        first[null_page * t].zero_()   # masked keys read this row: finite values, whatever was there
        return cls(first, t, null_page * t, tuple(kinds), tuple(slot), owners, source)


@dataclass
class DecodeTables:
    """One decode step's addresses: the tensor inputs of the graph, and where its new K/V go."""

    keys: list[torch.Tensor]     # per kind: [cols, rows, nb, KEY_BLOCK] token rows of each row's keys
    state: list[torch.Tensor]    # per kind: [rows, nb, KEY_BLOCK] int8, MASKED / SEEN / NEW + d (a new token)
    writes: torch.Tensor         # [owning layers, rows] token row of each layer's new K/V

    @classmethod
    def build(cls, layout: DecodeLayout, md: AttentionMetadata, rows: int,
              widths: list[int] | None = None) -> "DecodeTables":
        """Tables for a decode batch (one new token per sequence) padded to `rows` rows: padding
        rows see only their own new token and write to the null page. `widths`: per kind, at least
        this many key blocks (warm-up gives each kind a count of its own: torch.compile would
        otherwise take equal sizes for one symbol). In numpy: the same arithmetic as torch ops took
        ~0.5 ms of a 15 ms batch-1 step (a few microseconds of dispatch per op, ~40 ops)."""
        b, t = md.num_seqs, layout.tokens_per_page
        seqs = np.arange(b)[:, None]
        ends = np.asarray(md.seq_lens, dtype=np.int64)   # the new token sits at ends - 1
        # keys [ends - 1 - before, ends - 1) are the new tokens of the rows just before (not in the cache yet)
        before = np.asarray(md.new_before if md.new_before is not None else [0] * b, dtype=np.int64)
        if before.size and before.max() >= 127 - NEW:
            raise ValueError("a traced decode step takes fewer than 125 rows of one sequence")
        written: dict[int, np.ndarray] = {}   # group -> [cols, b] token row of each new token
        keys, state = [], []
        for i, (group, window) in enumerate(layout.kinds):
            tables = md.groups[group]
            block_rows = tables.block_rows.cpu().numpy()
            slot_pages = tables.slot_pages.cpu().numpy()
            first_block = np.asarray(tables.first_block, dtype=np.int64)[:, None]

            def token_rows(pos: np.ndarray) -> np.ndarray:   # positions [b, n] -> token rows [cols, b, n]
                pages = slot_pages[block_rows[seqs, pos // t - first_block]].astype(np.int64)   # [b, n, cols]
                return np.moveaxis(pages, -1, 0) * t + pos % t

            if group not in written:
                written[group] = token_rows(ends[:, None] - 1)[..., 0]
            first = np.zeros_like(ends) if window is None else np.maximum(ends - window, 0)
            lo = first // KEY_BLOCK * KEY_BLOCK
            nb = max(MIN_WIDTH, int(((ends - lo + KEY_BLOCK - 1) // KEY_BLOCK).max()), widths[i] if widths else 0)
            pos = lo[:, None] + np.arange(nb * KEY_BLOCK)[None, :]
            old = (pos >= first[:, None]) & (pos < (ends - 1 - before)[:, None])   # visible keys in the cache
            fresh = (pos >= first[:, None]) & (pos >= (ends - 1 - before)[:, None]) & (pos < ends[:, None])
            # One memory layout whatever the batch (padding rows: nothing old to see): a compiled
            # graph guards on its inputs' strides, and another layout would compile it again.
            padded = np.full((slot_pages.shape[1], rows, nb * KEY_BLOCK), layout.null_row, dtype=np.int64)
            padded[:, :b] = np.where(old, token_rows(np.clip(pos, first[:, None], ends[:, None] - 1)), layout.null_row)
            keys.append(torch.from_numpy(padded).view(-1, rows, nb, KEY_BLOCK))
            what = np.zeros((rows, nb * KEY_BLOCK), dtype=np.int8)
            what[:b][old] = SEEN
            what[:b][fresh] = (NEW + (ends[:, None] - 1 - pos))[fresh]   # NEW + d: the new token of row r - d
            what[b:, 0] = NEW   # a padding row's new token: position 0
            state.append(torch.from_numpy(what).view(rows, nb, KEY_BLOCK))
        writes = np.full((len(layout.owners), rows), layout.null_row, dtype=np.int64)   # padding: null page
        for n, layer in enumerate(layout.owners):
            kind, col = layout.slot[layer]
            writes[n, :b] = written[layout.kinds[kind][0]][col]
        return cls(keys, state, torch.from_numpy(writes))

    def commit(self, layout: DecodeLayout, new_kv: torch.Tensor) -> None:
        """Write the graph's new K/V [owning layers, rows, 2, Hkv, D] to the cache."""
        layout.kv.index_copy_(0, self.writes.reshape(-1), new_kv.reshape(-1, *layout.kv.shape[1:]))


class TracedDecodeAttention(BatchAttention):
    """The attention a compiled decode step traces (built inside the traced function from its inputs).
    After the forward, `new_kv()` holds what the runner commits."""

    def __init__(self, layout: DecodeLayout, kv: torch.Tensor, keys: list[torch.Tensor],
                 state: list[torch.Tensor]):
        self.layout, self.kv, self.keys, self.state = layout, kv, keys, state
        self._new: dict[int, torch.Tensor] = {}   # owning layer -> [rows, 2, Hkv, D]

    def __call__(self, layer, q, k, v, *, scale, window, softcap=None, bidirectional=False):
        if softcap is not None:
            raise NotImplementedError("attention soft-capping is not used by Gemma 3/4 text models")
        kind, col = self.layout.slot[layer]
        at = self.keys[kind][col].flatten(1)                               # [B, nk]
        state = self.state[kind].flatten(1)                                # [B, nk]
        if k is not None:
            self._new[layer] = torch.stack((k, v), 1).to(self.kv.dtype)
        new = self._new[self.layout.source[layer]]                          # [B, 2, Hkv, D]
        # each key read where it lies: the cache's row, or a row's new token (its own, or state NEW + d: the
        # one of the row d before)
        return attend_paged(q.unsqueeze(1), self.kv, at, new, state, scale).squeeze(1)

    def new_kv(self) -> torch.Tensor:
        return torch.stack([self._new[layer] for layer in self.layout.owners])
