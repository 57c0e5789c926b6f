"""Turns a scheduled batch into tensors, runs the model, returns logits of the rows to sample.

    seqs   a: 5 new tokens (prefill)   b: 1 (decode)   c: 1 (decode)
    input  [a0 a1 a2 a3 a4 | b7 | c3]        positions [0..4 | 7 | 3]
    sample rows: last token of every sequence that this step brings up to date
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.base import AttentionBackend, AttentionMetadata
from ..kv.base import KVCacheManager
from ..kv.spec import LayerSpec
from .scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: nn.Module, backend: AttentionBackend, kv: KVCacheManager, specs: list[LayerSpec],
                 device: torch.device):
        self.model = model
        self.backend = backend
        self.kv = kv
        self.device = device
        self.kv_cache = backend.allocate_kv_cache(specs, kv.num_pages, kv.page_size, device)

    def build_metadata(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        tables = [[self.kv.page_table(s.request.request_id, t) for s in seqs] for t in range(self.kv.num_tables)]
        for s in seqs:
            start = s.request.num_computed_tokens
            ids.extend(s.request.all_token_ids[start:start + s.num_new_tokens])
            positions.extend(range(start, start + s.num_new_tokens))
        pos = torch.tensor(positions, dtype=torch.long)
        ps = self.kv.page_size
        slot_mapping = []
        for table in tables:
            # pages[b] for every token, then slot = page * page_size + offset
            page_of_token = torch.cat([
                torch.tensor(pages, dtype=torch.long)[torch.arange(s.request.num_computed_tokens,
                                                                   s.request.num_computed_tokens + s.num_new_tokens) // ps]
                for pages, s in zip(table, seqs)])
            slot_mapping.append((page_of_token * ps + pos % ps).to(self.device))
        md = AttentionMetadata(
            query_lens=[s.num_new_tokens for s in seqs],
            seq_lens=[s.request.num_computed_tokens + s.num_new_tokens for s in seqs],
            page_tables=tables,
            slot_mapping=slot_mapping,
            layer_table=self.kv.layer_table,
            page_size=ps,
        )
        return torch.tensor(ids, dtype=torch.long, device=self.device), pos.to(self.device), md

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> torch.Tensor | None:
        """Run one step. Returns logits [N, V] for the N sequences with `completes` (in order)."""
        input_ids, positions, md = self.build_metadata(seqs)
        attn = self.backend.begin_batch(md, self.kv_cache)
        hidden = self.model(input_ids, positions, attn)
        rows, end = [], 0
        for s in seqs:
            end += s.num_new_tokens
            if s.completes:
                rows.append(end - 1)
        if not rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
