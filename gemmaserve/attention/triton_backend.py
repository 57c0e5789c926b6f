"""Attention through our Triton kernels (CUDA; on the CPU only under TRITON_INTERPRET=1, for tests).

Per batch and layer group, the block tables go to the device once: slot rows [B, W] -> pages of every
layer of the group [L, B, W] by one gather from a device mirror of the group's slot -> page table
(kept in sync row by row as slots come and go). Each layer then launches the store kernel and either
the decode kernel (every sequence has one new token) or the prefill kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..kv.base import KVLayout
from .base import AttentionBackend, AttentionMetadata, BackendCapabilities, BatchAttention
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
class _GroupBatch:
    pages: torch.Tensor        # [L, B, W] page of each live block, per layer column
    first_block: torch.Tensor  # [B]
    write_pages: torch.Tensor  # [L, T] page of each new token, per layer column
    write_offsets: torch.Tensor  # [T]
    max_keys: dict             # window -> most keys any sequence reads


class _Mirror:
    """Device copy of one group's slot -> page table, updated with the rows that changed."""

    def __init__(self) -> None:
        self.table: torch.Tensor | None = None
        self.cursor = -1

    def sync(self, tables, device: torch.device) -> torch.Tensor:
        host = tables.slot_pages
        rows, cursor = tables.changes_since(self.cursor)
        if self.table is None or self.table.shape != host.shape or rows is None:
            self.table = host.to(device=device, dtype=torch.int32).clone()
        elif rows:
            idx = torch.tensor(sorted(set(rows)), dtype=torch.long)
            self.table[idx.to(device)] = host[idx].to(device=device, dtype=torch.int32)
        self.cursor = cursor
        return self.table


class TritonBatchAttention(BatchAttention):
    def __init__(self, md: AttentionMetadata, kv_cache, specs, mirrors: list[_Mirror]):
        from . import triton_kernels as K

        self.K = K
        self.md = md
        self.kv_cache = kv_cache
        self.specs = specs
        dev = kv_cache[0][0].device
        self.device = dev
        self.decode = md.is_decode_only
        bsz = md.num_seqs
        self.seq_lens = torch.tensor(md.seq_lens, dtype=torch.int32, device=dev)
        qlens = torch.tensor(md.query_lens, dtype=torch.int32)
        self.query_lens = qlens.to(dev)
        starts = torch.zeros(bsz, dtype=torch.int32)
        starts[1:] = torch.cumsum(qlens, 0)[:-1]
        self.query_start = starts.to(dev)
        # position of every new token, and its sequence
        seq_of = torch.repeat_interleave(torch.arange(bsz), qlens.long())
        pos = torch.cat([torch.arange(s - n, s) for n, s in zip(md.query_lens, md.seq_lens)])
        self.groups: list[_GroupBatch] = []
        for tables, mirror in zip(md.groups, mirrors):
            width = max(1, max(len(r) for r in tables.slot_ids))
            rows = torch.zeros(bsz, width, dtype=torch.long)
            for b, r in enumerate(tables.slot_ids):
                rows[b, :len(r)] = torch.tensor(r, dtype=torch.long)
            table = mirror.sync(tables, dev)
            pages = table[rows.to(dev)].permute(2, 0, 1).contiguous()             # [L, B, W]
            first = torch.tensor(tables.first_block, dtype=torch.long)
            t = tables.group.tokens_per_page
            blk = (pos // t - first[seq_of]).to(dev)
            write_pages = pages[:, seq_of.to(dev), blk]                            # [L, T]
            self.groups.append(_GroupBatch(pages, first.to(device=dev, dtype=torch.int32), write_pages,
                                           (pos % t).to(device=dev, dtype=torch.int32), {}))
        self._tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _max_keys(self, gb: _GroupBatch, window: int | None) -> int:
        if window not in gb.max_keys:
            gb.max_keys[window] = max(min(s, window) if window else s for s in self.md.seq_lens)
        return gb.max_keys[window]

    def _tiles_for(self, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        bm = self.K.prefill_block_m(head_dim)
        if bm not in self._tiles:
            seqs, starts = self.K.prefill_tiles(self.md.query_lens, bm)
            self._tiles[bm] = (torch.tensor(seqs, dtype=torch.int32, device=self.device),
                               torch.tensor(starts, dtype=torch.int32, device=self.device))
        return self._tiles[bm]

    def __call__(self, layer, q, k, v, *, scale, window, softcap=None):
        if softcap is not None:
            raise NotImplementedError("attention soft-capping is not used by Gemma 3/4 text models")
        group, col = self.md.layer_slot[layer]
        gb = self.groups[group]
        k_cache, v_cache = self.kv_cache[layer]
        if self.specs[layer].owns_kv:
            self.K.store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, gb.write_pages[col], gb.write_offsets)
        q = q.contiguous()
        if self.decode:
            return self.K.decode_attention(q, k_cache, v_cache, gb.pages[col], gb.first_block, self.seq_lens, scale,
                                           window, self._max_keys(gb, window))
        tile_seq, tile_q = self._tiles_for(q.shape[-1])
        return self.K.prefill_attention(q, k_cache, v_cache, gb.pages[col], gb.first_block, self.query_start,
                                        self.query_lens, self.seq_lens, tile_seq, tile_q, scale, window)


class TritonAttentionBackend(AttentionBackend):
    capabilities = BackendCapabilities(name="triton", devices=frozenset({"cuda", "cpu"}), head_dims=None,
                                       scratch_pages=True, shared_arena=True)

    def __init__(self) -> None:
        self._specs = []
        self._mirrors: list[_Mirror] = []

    def allocate_kv_cache(self, specs, layout: KVLayout, device):
        self._specs = list(specs)
        return allocate_paged_kv(specs, layout, device)

    def begin_batch(self, metadata, kv_cache):
        while len(self._mirrors) < len(metadata.groups):
            self._mirrors.append(_Mirror())
        return TritonBatchAttention(metadata, kv_cache, self._specs, self._mirrors)
