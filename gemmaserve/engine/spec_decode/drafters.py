"""What the runner asks of a model that drafts tokens for speculative decoding (the scheduler's side is
proposers.py). A drafter works at one of two moments of a step:

    in the step    before the target's forward: fills the step's draft slots (DRAFT_TOKEN in a SeqStep)
                   with its guesses, which the target then verifies in the same forward (draft_model.py:
                   a smaller model with its own KV, run over every token the target runs)
    after the step from what the target's forward left behind (its hidden states, its KV): guesses at
                   the tokens after the one each sequence emitted last, for its next step (mtp.py)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ..step import SeqStep

if TYPE_CHECKING:
    from ..model_runner import ModelRunner


class Drafter(Protocol):
    lookback: int        # keys behind a sequence's next query that sliding KV groups must keep for it
    wants_hidden: bool   # after_step needs the target's hidden states of the sampled rows

    def in_step(self, runner: "ModelRunner", seqs: list[SeqStep], input_ids: torch.Tensor,
                positions: torch.Tensor) -> dict[str, list[int]] | None:
        """Fill the draft slots of `seqs` in `input_ids` (in place); the drafts per sequence, or None."""

    def after_step(self, runner: "ModelRunner", seqs: list[SeqStep], emitted: list[int], hidden: torch.Tensor,
                   tokens: torch.Tensor) -> tuple[list[str], list[int], torch.Tensor] | None:
        """Drafts for the sequences of `seqs` (those that sampled) that ask for them (`propose`): (their
        ids, how many each wants, [B, k] tokens on the device), or None."""
