"""The runner side of `draft_model` speculation: a smaller Gemma (the embedded 270M for a Gemma 3 target)
with its own KV layers in the target's pool, drafting inside the step, before the target's forward.

    KV      its layers come after the target's (the pool's layers L.., one pool, one budget, one block table
            per group; the model keeps its own ids 0.., OffsetLayers maps them): its KV follows the target's
            pages, prefix hits, preemption and rollback for free
    mirror  every row the target computes without drafts (prefill chunks, plain decodes) runs through
            the draft model too, so its KV covers every position the target's does
    drafts  a sequence with k draft slots at positions p+1..p+k (its last token t at p):
                forward i = 0..k over one token per sequence at p + i:   t, d1, ..., dk
                d(i+1) = argmax of forward i's logits (i < k)             the slots, filled on the device
            the last forward only writes dk's KV (all k accepted: the next step starts after it)

A slot the target rejects leaves KV behind at a position the next step computes again, in both models
(scheduler.py rolls back what it commits). The draft model never sees another model's tokens as its
own: ids beyond its vocabulary (a multimodal target's image tokens) read its pad row.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...attention.base import AttentionBackend, AttentionMetadata, BatchAttention
from ...device import to_device
from ...kv.spec import LayerSpec
from ...models.base import ModelInputs
from ..step import DRAFT_TOKEN, SeqStep


def offset_specs(specs: list[LayerSpec], offset: int) -> list[LayerSpec]:
    """The draft model's KV specs as layers offset.. of the pool (after the target's)."""
    return [s if s.kv_source is None else dataclasses.replace(s, kv_source=s.kv_source + offset) for s in specs]


class OffsetLayers(BatchAttention):
    """A batch's attention as the draft model sees it: its layers 0.. are the pool's layers offset.."""

    def __init__(self, inner: BatchAttention, offset: int):
        self.inner, self.offset = inner, offset

    def __call__(self, layer, q, k, v, **kwargs):
        return self.inner(layer + self.offset, q, k, v, **kwargs)

    def last_tokens(self, seqs: list[int]) -> "OffsetLayers":
        return OffsetLayers(self.inner.last_tokens(seqs), self.offset)


class DraftModelDrafter:
    """A drafter (drafters.py) that works in the step."""

    lookback = 0
    wants_hidden = False

    def __init__(self, model: nn.Module, backend: AttentionBackend, first_layer: int, pad_token_id: int = 0):
        """`first_layer`: the pool's id of the draft model's layer 0 (its layers follow the target's)."""
        self.model = model
        self.backend = backend
        self.first_layer = first_layer
        self.vocab_size = model.vocab_size
        self.pad = pad_token_id

    def _attention(self, runner, md: AttentionMetadata) -> OffsetLayers:
        return OffsetLayers(self.backend.begin_batch(md, runner.kv_cache), self.first_layer)

    def after_step(self, runner, seqs, emitted, hidden, tokens) -> None:
        return None

    @torch.inference_mode()
    def in_step(self, runner, seqs: list[SeqStep], input_ids: torch.Tensor,
                positions: torch.Tensor) -> dict[str, list[int]] | None:
        starts, row = [], 0
        for s in seqs:
            starts.append(row)
            row += s.num_new_tokens
        slots = [b for b, s in enumerate(seqs) if s.num_drafts and s.token_ids[-1] == DRAFT_TOKEN]
        plain = [b for b in range(len(seqs)) if b not in set(slots)]
        if plain:
            self._mirror(runner, [seqs[b] for b in plain], [starts[b] for b in plain], input_ids, positions)
        drafting = slots
        if not drafting:
            return None
        return self._draft(runner, [seqs[b] for b in drafting], [starts[b] for b in drafting], input_ids)

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.masked_fill(ids >= self.vocab_size, self.pad)

    def _mirror(self, runner, seqs: list[SeqStep], starts: list[int], input_ids: torch.Tensor,
                positions: torch.Tensor) -> None:
        """The draft model's KV for rows the target computes without draft slots."""
        rows = to_device([r for s, first in zip(seqs, starts) for r in range(first, first + s.num_new_tokens)],
                         torch.long, input_ids.device)
        md = AttentionMetadata([s.num_new_tokens for s in seqs], [s.start + s.num_new_tokens for s in seqs],
                               runner.tables.tables([s.req_id for s in seqs]), runner.layer_slot)
        self.model(ModelInputs(self._ids(input_ids[rows]), positions[rows], self._attention(runner, md)))

    def _draft(self, runner, seqs: list[SeqStep], starts: list[int],
               input_ids: torch.Tensor) -> dict[str, list[int]]:
        """Fill each sequence's draft slots (rows starts[b] + 1 ..) with greedy drafts, writing the draft
        model's KV for its last token and every draft."""
        device = input_ids.device
        k = [s.num_drafts for s in seqs]
        tokens = input_ids[to_device(starts, torch.long, device)]
        for i in range(max(k) + 1):
            # `tokens` holds one token per sequence with i <= k (a sequence has pages for its own slots only).
            active = [b for b in range(len(seqs)) if i <= k[b]]
            md = AttentionMetadata([1] * len(active), [seqs[b].start + i + 1 for b in active],
                                   runner.tables.tables([seqs[b].req_id for b in active]), runner.layer_slot)
            at = to_device([seqs[b].start + i for b in active], torch.long, device)
            hidden = self.model(ModelInputs(self._ids(tokens), at, self._attention(runner, md)))
            filling = [j for j, b in enumerate(active) if i < k[b]]
            if not filling:
                break
            tokens = self.model.compute_logits(hidden[to_device(filling, torch.long, device)]).argmax(dim=-1)
            input_ids[to_device([starts[active[j]] + 1 + i for j in filling], torch.long, device)] = tokens
        slots = to_device([r for b, first in enumerate(starts) for r in range(first + 1, first + 1 + k[b])],
                          torch.long, device)
        flat, out, j = input_ids[slots].tolist(), {}, 0
        for s, n in zip(seqs, k):
            out[s.req_id] = flat[j:j + n]
            j += n
        return out
