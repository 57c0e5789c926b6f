"""The runner side of MTP drafting: right after a step, a Gemma 4 drafter guesses the next k tokens of each
sequence that asked for drafts (SeqStep.propose), from what the step left behind.

    input   the token the step emitted last (t, at position p) and the target's hidden state at p - 1
            (the row that chose t); the target's KV of positions [0, p), just written
    round   k drafter forwards of one query per sequence, all at position p:
                h = drafter([embed(t) ; hidden]);  t = argmax head(h);  hidden = post_projection(h)

The drafter writes no KV, so nothing here needs rolling back; the target's rejected positions (>= p) are
never read. The tokens stay on the device until the step's result is resolved.
"""

from __future__ import annotations

import torch

from ...attention.base import AttentionBackend, AttentionMetadata
from ...device import to_device
from ...kv.base import GroupTables
from ...models.base import ModelInputs
from ...models.gemma4_assistant import Gemma4Assistant
from ..step import SeqStep


class MtpDrafter:
    """A drafter (drafters.py) that works after the step."""

    wants_hidden = True

    def __init__(self, assistant: Gemma4Assistant, target: torch.nn.Module, backend: AttentionBackend,
                 lookback: int = 0):
        """`lookback`: keys behind a sequence's next query that the KV manager must keep for the drafter."""
        self.assistant = assistant
        self.lookback = lookback
        self.target = target   # its `embed(ids)`: the drafter reads tokens through the target's embedding
        self.backend = backend
        self.dtype = assistant.pre_projection.weight.dtype

    def in_step(self, runner, seqs, input_ids, positions) -> None:
        return None

    def after_step(self, runner, seqs: list[SeqStep], emitted: list[int], hidden: torch.Tensor,
                   tokens: torch.Tensor) -> tuple[list[str], list[int], torch.Tensor] | None:
        """`hidden` holds a row per sampled position of `seqs`, `tokens` each sequence's last emitted token
        and `emitted` how many it emitted: the last one's row chose the token the drafts follow."""
        rows, chosen, lengths, want = [], [], [], []
        first = 0
        for b, (s, n) in enumerate(zip(seqs, emitted)):
            if s.propose:
                rows.append(first + n - 1)
                chosen.append(b)
                lengths.append(s.start + s.num_new_tokens - s.num_drafts + n - 1)   # committed KV: [0, p)
                want.append(s.propose)
            first += s.num_drafts + 1
        if not chosen:
            return None
        ids = [seqs[b].req_id for b in chosen]
        device = hidden.device
        drafts = self.draft(hidden[to_device(rows, torch.long, device)], tokens[to_device(chosen, torch.long, device)],
                            lengths, runner.tables.tables(ids), runner.layer_slot, runner.kv_cache, max(want))
        return ids, want, drafts

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, lengths: list[int], groups: list[GroupTables],
              layer_slot: tuple[tuple[int, int], ...], kv_cache, k: int) -> torch.Tensor:
        """[B, k] drafts for B sequences: `hidden` [B, H] the target's hidden states, `tokens` [B] the tokens
        they chose, `lengths` the committed positions p (KV of [0, p) is in `kv_cache`)."""
        md = AttentionMetadata([1] * len(lengths), list(lengths), groups, layer_slot)
        attn = self.backend.begin_batch(md, kv_cache)
        positions = to_device(lengths, torch.long, hidden.device)
        out = []
        for _ in range(k):
            x = torch.cat([self.target.embed(tokens).to(self.dtype), hidden.to(self.dtype)], dim=-1)
            h = self.assistant(ModelInputs(None, positions, attn, inputs_embeds=x))
            tokens = self.assistant.draft(h)
            out.append(tokens)
            hidden = self.assistant.project(h)
        return torch.stack(out, dim=1)
