"""CUDA graphs for decode steps: one graph per padded batch size, captured when the engine starts.

A decode step launches ~12 kernels per layer; at small batches launch overhead, not the GPU, sets the
pace. Replaying a captured graph issues them all at once. Inputs live at fixed addresses (the
backend's `GraphInputs`, shared by all sizes): each step copies the live batch in (padding rows read
and write a reserved null page) and replays the graph of the smallest size that fits.

Steps with LoRA rows replay graphs of their own, captured on the first such step of each size (the adapters'
stacked slots exist from the first load on, at fixed addresses): every stacked module's segment kernels are in
them, reading each row's slot and the slot order from buffers filled per step (padding rows: no slot).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch
from torch import nn

from ...attention.base import AttentionBackend
from ...models.base import ModelInputs
from ...models.lora import LoRABatch, LoRAWeights

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
        # One side stream for every capture's warm-up: torch keeps a cuBLAS workspace (32 MiB on Hopper) for each
        # stream a matmul ever ran on, for the process's life. A stream per batch size would leave one per size
        # behind a dropped engine (gpu_lifetime on an H100: 0.28 GiB per engine = 9 sizes x 32 MiB).
        self._warmup_stream = torch.cuda.Stream(device)
        self._graphs: dict[int, _Graph] = {}
        self._lora_graphs: dict[int, _Graph] = {}
        self.lora_slots = torch.full((max_batch,), -1, dtype=torch.int32, device=device)
        self.lora_order = torch.arange(max_batch, dtype=torch.int32, device=device)
        self._rows = torch.arange(max_batch, dtype=torch.int32, device=device)
        self.capture_seconds = 0.0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def capture_all(self) -> None:
        start = time.perf_counter()
        for size in reversed(self.sizes):   # largest first: later graphs reuse its memory pool
            self._capture(size)
        self.capture_seconds = time.perf_counter() - start

    @property
    def lora_sizes(self) -> list[int]:
        """The padded batch sizes whose LoRA graphs are captured so far."""
        return sorted(self._lora_graphs)

    def graph(self, size: int) -> torch.cuda.CUDAGraph:
        """The captured graph of a padded batch size (benchmarks replay it alone)."""
        return self._graphs[size].graph

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata,
            lora: LoRABatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden states) of a decode batch: views of the graph's outputs until its next replay.
        `lora`: the batch's adapters (stacked layout, a slot per input row)."""
        b = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, b)]
        if lora is None:
            g = self._graphs.get(size) or self._capture(size)
        else:
            g = self._lora_graphs.get(size) or self._capture(size, lora.weights)
            self.lora_slots[:b].copy_(lora.slots)
            self.lora_slots[b:size].fill_(-1)
            self.lora_order[:b].copy_(lora.order)
            self.lora_order[b:size].copy_(self._rows[b:size])   # padding rows: themselves, no slot
        self.inputs.fill(metadata, size)
        self.input_ids[:b].copy_(input_ids)
        self.input_ids[b:size].zero_()
        self.positions[:b].copy_(positions)
        self.positions[b:size].zero_()
        g.graph.replay()
        return g.logits[:b], g.hidden[:b]

    @torch.inference_mode()
    def _capture(self, size: int, lora_weights: LoRAWeights | None = None) -> _Graph:
        ids, pos = self.input_ids[:size], self.positions[:size]
        ids.zero_()
        pos.zero_()
        self.inputs.fill(None, size)   # every row is padding: writes hit the null page
        attn = self.inputs.attention(size, self.layer_slot, self.kv_cache)
        lora = None
        if lora_weights is not None:
            self.lora_slots[:size].fill_(-1)
            self.lora_order[:size].copy_(self._rows[:size])
            lora = LoRABatch(lora_weights, {}, self.lora_slots[:size], self.lora_order[:size], captured=True)
        stream = self._warmup_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm-up off the capture (compiles the kernels)
            self.model.compute_logits(self.model(ModelInputs(ids, pos, attn, lora=lora)))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(ModelInputs(ids, pos, attn, lora=lora))
            logits = self.model.compute_logits(hidden)
        g = _Graph(graph, logits, hidden)
        (self._graphs if lora is None else self._lora_graphs)[size] = g
        return g
