"""CUDA graphs for decode steps: one graph per padded batch size, captured when the engine starts.

A decode step launches ~12 kernels per layer; at small batches launch overhead, not the GPU, sets the
pace. Replaying a captured graph issues them all at once. Inputs live at fixed addresses (the
backend's `GraphInputs`, shared by all sizes): each step copies the live batch in (padding rows read
and write a reserved null page) and replays the graph of the smallest size that fits.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..models.base import ModelInputs

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    hidden: torch.Tensor   # the final hidden states (a drafter reads them)


class DecodeGraphs:
    def __init__(self, model: nn.Module, backend: AttentionBackend, kv_cache, layer_slot, groups, max_model_len: int,
                 null_page: int, max_batch: int, device: torch.device, extra_keys: int = 0):
        """`extra_keys`: keys a sliding table may hold beyond its window (speculation: drafts, lookback)."""
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.layer_slot = layer_slot
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [max_batch]
        self.inputs = backend.graph_inputs(max_batch, groups, max_model_len, null_page, device, extra_keys)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, _Graph] = {}
        self.capture_seconds = 0.0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def capture_all(self) -> None:
        start = time.perf_counter()
        for size in reversed(self.sizes):   # largest first: later graphs reuse its memory pool
            self._capture(size)
        self.capture_seconds = time.perf_counter() - start

    def graph(self, size: int) -> torch.cuda.CUDAGraph:
        """The captured graph of a padded batch size (benchmarks replay it alone)."""
        return self._graphs[size].graph

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden states) of a decode batch: views of the graph's outputs until its next replay."""
        b = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, b)]
        g = self._graphs.get(size) or self._capture(size)
        self.inputs.fill(metadata, size)
        self.input_ids[:b].copy_(input_ids)
        self.input_ids[b:size].zero_()
        self.positions[:b].copy_(positions)
        self.positions[b:size].zero_()
        g.graph.replay()
        return g.logits[:b], g.hidden[:b]

    @torch.inference_mode()
    def _capture(self, size: int) -> _Graph:
        ids, pos = self.input_ids[:size], self.positions[:size]
        ids.zero_()
        pos.zero_()
        self.inputs.fill(None, size)   # every row is padding: writes hit the null page
        attn = self.inputs.attention(size, self.layer_slot, self.kv_cache)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm-up off the capture (compiles the kernels)
            self.model.compute_logits(self.model(ModelInputs(ids, pos, attn)))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(ModelInputs(ids, pos, attn))
            logits = self.model.compute_logits(hidden)
        g = _Graph(graph, logits, hidden)
        self._graphs[size] = g
        return g
