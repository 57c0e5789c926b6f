"""A batch's attention behind one custom op, so that a compiled model graph can call it.

A compiled decode step (engine/compile/compiled_decode.py) traces the model once and runs the graph every
step, but each step's attention is a different `BatchAttention` with Python plans (pages, masks)
that must not be traced. The graph instead calls `gemmaserve::batch_attention` with an
`AttentionHandle`, an opaque reference the runner points at the step's batch before each run:

    compiled graph: ... q, k, v -> batch_attention(q, k, v, handle, layer, ...) -> o_proj ...
    runner, each step: handle.batch = backend.begin_batch(metadata, kv_cache); graph(ids, positions)

A graph for more rows than the batch has pads them (`handle.rows` are real): the op attends for the
real rows only and returns zeros for the rest, which write no KV and whose logits nobody reads.

The op writes the layer's new K/V into the cache and reads it, a side effect the graph does not see;
it is safe because every layer's call depends on the previous layer's output (nothing reorders them).
"""

from __future__ import annotations

import torch

from .. import opaque
from .base import BatchAttention


@opaque.opaque_reference
class AttentionHandle(opaque.OpaqueRef):
    """Points at the `BatchAttention` of the step a compiled graph is running."""

    def __init__(self) -> None:
        self.batch: BatchAttention | None = None
        self.rows = 0   # the batch's rows: a graph for more rows pads the rest (they attend to nothing)


if opaque.SUPPORTED:
    @torch.library.custom_op("gemmaserve::batch_attention", mutates_args=())
    def _batch_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, handle: AttentionHandle,
                         layer: int, scale: float, window: int, bidirectional: bool) -> torch.Tensor:
        if handle.batch is None:
            raise RuntimeError("a compiled step ran without a batch attention")
        n = handle.rows

        def rows(x: torch.Tensor | None) -> torch.Tensor | None:
            return x if x is None or x.shape[0] == n else x[:n]

        o = handle.batch(layer, rows(q), rows(k), rows(v), scale=scale, window=None if window < 0 else window,
                         bidirectional=bidirectional)
        if n < q.shape[0]:
            o = torch.cat([o, o.new_zeros(q.shape[0] - n, *o.shape[1:])])
        # The graph lays its next op out by the fake kernel's strides (contiguous) and does not check.
        return o.contiguous()

    @_batch_attention.register_fake
    def _(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, handle: AttentionHandle,
          layer: int, scale: float, window: int, bidirectional: bool) -> torch.Tensor:
        return q.new_empty(q.shape)


class HandleAttention(BatchAttention):
    """What a compiled model calls: forwards every layer to the handle's batch through the op."""

    def __init__(self, handle: AttentionHandle):
        self.handle = handle

    def __call__(self, layer, q, k, v, *, scale, window, softcap=None, bidirectional=False):
        if softcap is not None:
            raise NotImplementedError("attention soft-capping is not used by Gemma 3/4 text models")
        return torch.ops.gemmaserve.batch_attention(q, k, v, self.handle, layer, scale,
                                                    -1 if window is None else window, bidirectional)
