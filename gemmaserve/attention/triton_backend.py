"""Attention through our Triton kernels (CUDA; on the CPU only under TRITON_INTERPRET=1, for tests).

Per batch and layer group, the block tables arrive on the device (the runner keeps them there):
slot rows [B, W] -> pages of every layer of the group [L, B, W] by one gather from the group's
slot -> page table. Each layer then launches the store kernel and either
the decode kernel (every sequence has one new token) or the prefill kernel.

CUDA graphs (decode only): `DecodeGraphBuffers` holds the same tensors at fixed addresses; a graph of
padded batch size s uses the first s rows, padding rows read and write a reserved null page, and the
split-K grid depends on the batch size only, so one graph per size serves every decode step.

Batch invariance (`--batch-invariant`, `backend.batch_invariant`): decode rows run through the prefill
kernel too, as one-token tiles, so every query reduces over its keys the same way wherever it is: in a
decode step of any size (eager or graph), in a mixed step, or inside a prefill chunk of any split. That
kernel's key tiles start at multiples of BLOCK_N in absolute positions whatever the chunk, its tile
constants depend on the head dim and dtype only, and blocks a row cannot see leave its running softmax
state exactly as it was (scale 1, additions of 0). The split-K decode kernel is not used: its split
count follows the batch size (`decode_splits`) and its merge adds the splits in another order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from ..device import to_device
from ..kv.base import KVLayout
from .base import AttentionBackend, AttentionMetadata, BackendCapabilities, BatchAttention, GraphInputs
from .kv_quant import layer_scales
from .torch_backend import allocate_paged_kv


def triton_available(device: torch.device) -> str | None:
    """None if the Triton backend can run on `device`, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs on the CPU only under TRITON_INTERPRET=1 (the interpreter, for tests)"
    if device.type not in ("cpu", "cuda"):
        return f"Triton does not run on {device.type}"
    return None


@dataclass
class GroupBatch:
    pages: torch.Tensor          # [L, B, W] page of each live block, per layer column
    first_block: torch.Tensor    # [B]
    write_pages: torch.Tensor    # [L, T] page of each new token, per layer column
    write_offsets: torch.Tensor  # [T]


@dataclass
class DeviceBatch:
    """Everything the kernels need for one forward pass, on the device."""

    decode: bool
    seq_lens: torch.Tensor                      # [B]
    groups: list[GroupBatch]
    max_keys: list[int]                          # per group: most keys a sequence keeps (group window applied)
    query_start: torch.Tensor | None = None     # prefill only
    query_lens: torch.Tensor | None = None
    query_ends: torch.Tensor | None = None      # [T] keys end (exclusive) per new token: images (prefill only)
    tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Batch invariance, decode only: (query_start, query_lens, tile_seq, tile_q) of one-token tiles.
    decode_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def decode_rows(iota: torch.Tensor, ones: torch.Tensor, zeros: torch.Tensor, size: int):
    """A decode batch as the prefill kernel reads it: sequence b's one query is row b, in tile b at offset 0."""
    return iota[:size], ones[:size], iota[:size], zeros[:size]


def build_device_batch(md: AttentionMetadata, device: torch.device) -> DeviceBatch:
    bsz = md.num_seqs
    qlens = np.asarray(md.query_lens, dtype=np.int64)
    seq_lens = np.asarray(md.seq_lens, dtype=np.int64)
    seq_of = np.repeat(np.arange(bsz), qlens)
    pos = np.arange(int(qlens.sum())) - np.repeat(np.cumsum(qlens) - qlens, qlens) + np.repeat(seq_lens - qlens, qlens)
    seq_of_dev = to_device(seq_of, torch.long, device)
    groups = []
    max_keys: list[int] = []
    for tables in md.groups:
        pages = tables.slot_pages[tables.block_rows].permute(2, 0, 1).contiguous()   # [L, B, W]
        first = np.asarray(tables.first_block, dtype=np.int64)
        t = tables.group.tokens_per_page
        blk = to_device(pos // t - first[seq_of], torch.long, device)
        groups.append(GroupBatch(pages, to_device(first, torch.int32, device), pages[:, seq_of_dev, blk],
                                 to_device(pos % t, torch.int32, device)))
        window = tables.group.window
        max_keys.append(int(np.minimum(seq_lens, window).max() if window else seq_lens.max()))
    batch = DeviceBatch(md.is_decode_only, to_device(seq_lens, torch.int32, device), groups, max_keys)
    if not batch.decode:
        starts = np.cumsum(qlens) - qlens
        batch.query_start = to_device(starts, torch.int32, device)
        batch.query_lens = to_device(qlens, torch.int32, device)
        ends = md.query_ends()
        if ends is not None:
            batch.query_ends = to_device(ends, torch.int32, device)
    return batch


class DecodeGraphBuffers:
    """Fixed-address inputs of captured decode graphs: one set for the largest batch; the graph of a
    smaller padded size uses the leading rows (`view(size)`). Keys are split a fixed number of ways
    per sequence (set by batch size, not context), so graphs do not depend on context length."""

    def __init__(self, max_size: int, groups_geometry: list[tuple[int, int, int | None]], max_model_len: int,
                 null_page: int, device: torch.device, extra_keys: int = 0):
        """groups_geometry: per group (layers, tokens per page, window). `extra_keys`: keys a sliding table
        holds beyond its window (a verification step's drafts, a drafter's lookback)."""
        self.null_page = null_page
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.groups: list[GroupBatch] = []
        self.max_keys: list[int] = []
        for layers, t, window in groups_geometry:
            width = -(-(min(window + extra_keys, max_model_len) if window else max_model_len) // t) + 1
            self.groups.append(GroupBatch(
                torch.full((layers, max_size, width), null_page, dtype=torch.int32, device=device),
                torch.zeros(max_size, dtype=torch.int32, device=device),
                torch.full((layers, max_size), null_page, dtype=torch.int32, device=device),
                torch.zeros(max_size, dtype=torch.int32, device=device)))
            self.max_keys.append(min(window, max_model_len) if window else max_model_len)
        # Batch invariance: the one-token tiles of `decode_rows`, at fixed addresses too.
        self.iota = torch.arange(max_size, dtype=torch.int32, device=device)
        self.ones = torch.ones(max_size, dtype=torch.int32, device=device)
        self.zeros = torch.zeros(max_size, dtype=torch.int32, device=device)

    def view(self, size: int) -> DeviceBatch:
        groups = [GroupBatch(g.pages[:, :size], g.first_block[:size], g.write_pages[:, :size], g.write_offsets[:size])
                  for g in self.groups]
        return DeviceBatch(True, self.seq_lens[:size], groups, list(self.max_keys),
                           decode_rows=decode_rows(self.iota, self.ones, self.zeros, size))

    def fill(self, live: DeviceBatch, size: int) -> None:
        """Copy a decode batch of B <= size sequences in; rows B..size read and write the null page."""
        b = live.seq_lens.shape[0]
        self.seq_lens[:b].copy_(live.seq_lens)
        self.seq_lens[b:size].fill_(1)
        for dst, src in zip(self.groups, live.groups):
            w = src.pages.shape[2]
            dst.pages[:, :b, :w].copy_(src.pages)
            dst.pages[:, b:size].fill_(self.null_page)
            dst.first_block[:b].copy_(src.first_block)
            dst.first_block[b:size].zero_()
            dst.write_pages[:, :b].copy_(src.write_pages)
            dst.write_pages[:, b:size].fill_(self.null_page)
            dst.write_offsets[:b].copy_(src.write_offsets)
            dst.write_offsets[b:size].zero_()


class TritonGraphInputs(GraphInputs):
    def __init__(self, backend: "TritonAttentionBackend", buffers: DecodeGraphBuffers):
        self.backend = backend
        self.buffers = buffers

    def fill(self, metadata: AttentionMetadata | None, size: int) -> None:
        self.buffers.fill(self.buffers.view(0) if metadata is None else self.backend.prepare(metadata), size)

    def attention(self, size, layer_slot, kv_cache):
        return self.backend.attention_for(self.buffers.view(size), layer_slot, kv_cache)


class TritonBatchAttention(BatchAttention):
    def __init__(self, batch: DeviceBatch, layer_slot, kv_cache, specs, query_lens: list[int] | None = None,
                 sm_count: int = 132, metadata: AttentionMetadata | None = None,
                 backend: "TritonAttentionBackend | None" = None, batch_invariant: bool = False):
        from . import triton_kernels as K

        self.K = K
        self.sm_count = sm_count
        self.batch_invariant = batch_invariant
        self.batch = batch
        self.layer_slot = layer_slot
        self.kv_cache = kv_cache
        self.specs = specs
        self._query_lens = query_lens
        self._metadata = metadata
        self._backend = backend

    def last_tokens(self, seqs):
        if self._metadata is None or self._backend is None:
            raise NotImplementedError("a captured decode batch cannot be narrowed")
        return self._backend.begin_batch(self._metadata.last_tokens(seqs), self.kv_cache)

    def _tiles_for(self, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        bm = self.K.prefill_block_m(head_dim)
        if bm not in self.batch.tiles:
            seqs, starts = self.K.prefill_tiles(self._query_lens, bm)
            dev = self.batch.seq_lens.device
            self.batch.tiles[bm] = (to_device(seqs, torch.int32, dev), to_device(starts, torch.int32, dev))
        return self.batch.tiles[bm]

    def _decode_rows(self):
        if self.batch.decode_rows is None:   # an eager decode batch: made once, on the device (no copy)
            n = self.batch.seq_lens.shape[0]
            dev = self.batch.seq_lens.device
            iota = torch.arange(n, dtype=torch.int32, device=dev)
            self.batch.decode_rows = decode_rows(iota, torch.ones_like(iota), torch.zeros_like(iota), n)
        return self.batch.decode_rows

    def __call__(self, layer, q, k, v, *, scale, window, softcap=None, bidirectional=False):
        if softcap is not None:
            raise NotImplementedError("attention soft-capping is not used by Gemma 3/4 text models")
        group, col = self.layer_slot[layer]
        gb = self.batch.groups[group]
        k_cache, v_cache = self.kv_cache[layer]
        # Plain floats: a captured graph bakes them in, and they are fixed for the engine's life.
        k_scale, v_scale = layer_scales(self.specs, layer)
        if k is not None and self.specs[layer].owns_kv:   # k None: a reader (MTP drafter); k, v may be strided views (rows of qkv): the kernel takes strides
            self.K.store_kv(k, v, k_cache, v_cache, gb.write_pages[col], gb.write_offsets, k_scale, v_scale)
        q = q.contiguous()
        if self.batch.decode and self.batch_invariant:
            query_start, query_lens, tile_seq, tile_q = self._decode_rows()
            return self.K.prefill_attention(q, k_cache, v_cache, gb.pages[col], gb.first_block, query_start, query_lens,
                                            self.batch.seq_lens, tile_seq, tile_q, scale, window,
                                            k_scale=k_scale, v_scale=v_scale)
        if self.batch.decode:
            keys = self.batch.max_keys[group]   # a layer's own window can be narrower than its group's (V1)
            splits = self.K.decode_splits(q.shape[0], k_cache.shape[2], min(keys, window) if window else keys,
                                          self.sm_count)
            return self.K.decode_attention(q, k_cache, v_cache, gb.pages[col], gb.first_block, self.batch.seq_lens,
                                           scale, window, splits, k_scale=k_scale, v_scale=v_scale)
        tile_seq, tile_q = self._tiles_for(q.shape[-1])
        return self.K.prefill_attention(q, k_cache, v_cache, gb.pages[col], gb.first_block, self.batch.query_start,
                                        self.batch.query_lens, self.batch.seq_lens, tile_seq, tile_q, scale, window,
                                        k_scale=k_scale, v_scale=v_scale,
                                        query_ends=self.batch.query_ends if bidirectional else None)


class TritonAttentionBackend(AttentionBackend):
    capabilities = BackendCapabilities(name="triton", devices=frozenset({"cuda", "cpu"}), head_dims=None,
                                       scratch_pages=True, shared_arena=True, cuda_graphs=True, batch_invariant=True)

    def __init__(self) -> None:
        self._specs = []
        self.device: torch.device | None = None
        self.sm_count = 132   # decode split heuristic; the real count on CUDA

    def allocate_kv_cache(self, specs, layout: KVLayout, device):
        self._specs = list(specs)
        self.device = device
        if device.type == "cuda":
            self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        return allocate_paged_kv(specs, layout, device)

    def prepare(self, metadata: AttentionMetadata) -> DeviceBatch:
        return build_device_batch(metadata, self.device)

    def attention_for(self, batch: DeviceBatch, layer_slot, kv_cache, query_lens: list[int] | None = None,
                      metadata: AttentionMetadata | None = None) -> TritonBatchAttention:
        return TritonBatchAttention(batch, layer_slot, kv_cache, self._specs, query_lens, self.sm_count, metadata,
                                    self if metadata is not None else None, self.batch_invariant)

    def graph_inputs(self, max_batch, groups, max_model_len, null_page, device, extra_keys=0) -> TritonGraphInputs:
        geometry = [(g.num_layers, g.tokens_per_page, g.window) for g in groups]
        return TritonGraphInputs(self, DecodeGraphBuffers(max_batch, geometry, max_model_len, null_page, device,
                                                          extra_keys))

    def begin_batch(self, metadata, kv_cache):
        return self.attention_for(self.prepare(metadata), metadata.layer_slot, kv_cache, metadata.query_lens,
                                  metadata)
