"""Turns a scheduled batch into tensors, runs the model, returns logits of the rows to sample.

    seqs   a: 5 new tokens (prefill)   b: 1 (decode)   c: 1 (decode)
    input  [a0 a1 a2 a3 a4 | b7 | c3]        positions [0..4 | 7 | 3]
    sample rows: last token of every sequence that this step brings up to date
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..attention.base import AttentionBackend, AttentionMetadata
from ..kv.base import KVCacheManager
from ..kv.spec import LayerSpec
from ..models.base import ModelInputs
from .scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: nn.Module, backend: AttentionBackend, kv: KVCacheManager, specs: list[LayerSpec],
                 device: torch.device, cuda_graphs: bool = False, max_model_len: int = 0, max_batch: int = 0):
        self.model = model
        self.backend = backend
        self.kv = kv
        self.device = device
        # One page more than the manager hands out: the null page that CUDA-graph padding rows use.
        layout = dataclasses.replace(kv.layout, num_pages=kv.layout.num_pages + 1)
        self.kv_cache = backend.allocate_kv_cache(specs, layout, device)
        self.graphs = None
        if cuda_graphs:
            from .cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, backend, self.kv_cache, kv.layer_slot, kv.groups, max_model_len,
                                       kv.num_pages, max_batch, device)
            self.graphs.capture_all()

    def build_metadata(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        for s in seqs:
            start = s.request.num_computed_tokens
            ids.extend(s.request.all_token_ids[start:start + s.num_new_tokens])
            positions.extend(range(start, start + s.num_new_tokens))
        md = AttentionMetadata(
            query_lens=[s.num_new_tokens for s in seqs],
            seq_lens=[s.request.num_computed_tokens + s.num_new_tokens for s in seqs],
            groups=self.kv.group_tables([s.request.request_id for s in seqs]),
            layer_slot=self.kv.layer_slot,
        )
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), md)

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> torch.Tensor | None:
        """Run one step. Returns logits [N, V] for the N sequences with `completes` (in order)."""
        input_ids, positions, md = self.build_metadata(seqs)
        rows, sampled, end = [], [], 0
        for b, s in enumerate(seqs):
            end += s.num_new_tokens
            if s.completes:
                rows.append(end - 1)
                sampled.append(b)
        if self.graphs is not None and md.is_decode_only and len(seqs) <= self.graphs.max_size:
            logits = self.graphs.run(input_ids, positions, md)   # a logit row per sequence
            if len(sampled) == len(seqs):
                return logits
            # A one-token row can be a prefill chunk that does not complete its prompt: no sample.
            return logits[torch.tensor(sampled, dtype=torch.long, device=logits.device)] if sampled else None
        attn = self.backend.begin_batch(md, self.kv_cache)
        inputs = ModelInputs(input_ids, positions, attn)
        if len(rows) != end:   # prefill chunks: only the last row of completing sequences is sampled
            inputs.sample_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
            inputs.sample_seqs = sampled
        hidden = self.model(inputs)
        if not rows:
            return None
        return self.model.compute_logits(hidden)
