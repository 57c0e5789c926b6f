"""CUDA graphs for decode steps: one graph per (padded batch size, context bucket).

A decode step launches ~15 kernels per layer; at small batches launch overhead, not the GPU, sets
the pace. Replaying a captured graph issues them all at once. Inputs live at fixed addresses
(`DecodeGraphBuffers`): each step copies the live batch in (padding rows read and write a reserved
null page) and replays. Graphs are captured on first use of a (size, bucket) pair; the bucket bounds
the context length, which sizes the split-K grid of the attention kernel.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch import nn

from ..attention.triton_backend import DecodeGraphBuffers

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
CONTEXT_BUCKETS = (2048, 8192, 32768, 131072, 262144)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    buffers: DecodeGraphBuffers
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    def __init__(self, model: nn.Module, backend, kv_cache, layer_slot, groups, max_model_len: int,
                 null_page: int, max_batch: int, device: torch.device):
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.layer_slot = layer_slot
        self.geometry = [(g.num_layers, g.tokens_per_page, g.window) for g in groups]
        self.buckets = sorted({b for b in CONTEXT_BUCKETS if b < max_model_len} | {max_model_len})
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [max_batch]
        self.null_page = null_page
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        b = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, b)]
        bucket = self.buckets[bisect.bisect_left(self.buckets, max(metadata.seq_lens))]
        g = self._graphs.get((size, bucket)) or self._capture(size, bucket)
        g.buffers.fill(self.backend.prepare(metadata))
        g.input_ids[:b].copy_(input_ids)
        g.input_ids[b:].zero_()
        g.positions[:b].copy_(positions)
        g.positions[b:].zero_()
        g.graph.replay()
        return g.logits[:b]

    @torch.inference_mode()
    def _capture(self, size: int, bucket: int) -> _Graph:
        buffers = DecodeGraphBuffers(size, self.geometry, bucket, self.null_page, self.device)
        input_ids = torch.zeros(size, dtype=torch.long, device=self.device)
        positions = torch.zeros(size, dtype=torch.long, device=self.device)
        attn = self.backend.attention_for(buffers.batch, self.layer_slot, self.kv_cache)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm-up off the capture: compiles the kernels (writes hit the null page)
            self.model.compute_logits(self.model(input_ids, positions, attn))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.compute_logits(self.model(input_ids, positions, attn))
        g = _Graph(graph, buffers, input_ids, positions, logits)
        self._graphs[(size, bucket)] = g
        return g
