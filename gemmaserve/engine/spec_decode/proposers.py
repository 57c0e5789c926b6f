"""Draft proposers for speculative decoding: guesses at a sequence's next tokens, which the target
checks in one forward (spec_decode.py). A wrong guess costs compute, never output.

    ngram (prompt lookup)   the tokens that followed the latest earlier occurrence of the sequence's last
                            n tokens, for n from prompt_lookup_max down to prompt_lookup_min: no model,
                            pays where the output copies its input (edits, extraction, summaries)
    runner drafts (mtp)     a model that needs the target's hidden states and KV drafts on the runner, right
                            after the step that sampled the request's last token (SeqStep.propose, mtp.py);
                            the scheduler keeps them on the request until its next step uses them
    draft slots (draft_model)  the step carries k empty slots (DRAFT_TOKEN) that the runner's draft model
                            fills before the target verifies them, in the same step (draft_model.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ...config.speculative import SpeculativeConfig
from ..request import Request
from ..step import DRAFT_TOKEN


class Proposer(Protocol):
    num_speculative_tokens: int
    drafts_after_step: bool   # the runner drafts after each step that samples (SeqStep.propose)

    def propose(self, req: Request, limit: int) -> list[int]:
        """At most `limit` (and at most num_speculative_tokens) guesses at the tokens after `req`'s."""


@dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int
    max_n: int
    min_n: int
    drafts_after_step = False

    def propose(self, req: Request, limit: int) -> list[int]:
        return self.lookup(req.all_token_ids, limit)

    def lookup(self, token_ids: list[int], limit: int) -> list[int]:
        k = min(self.num_speculative_tokens, limit)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            # Every earlier window of n tokens (the suffix itself excluded: it has no continuation).
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n   # the latest occurrence: the most recent context repeats best
                return ids[start:start + k].tolist()
        return []


@dataclass(frozen=True)
class RunnerDrafts:
    """Drafts the runner made after the request's last step (`Request.drafts`)."""

    num_speculative_tokens: int
    drafts_after_step = True

    def propose(self, req: Request, limit: int) -> list[int]:
        return req.drafts[:max(0, limit)]


@dataclass(frozen=True)
class DraftSlots:
    """Empty slots the runner's draft model fills in the step itself."""

    num_speculative_tokens: int
    drafts_after_step = False

    def propose(self, req: Request, limit: int) -> list[int]:
        return [DRAFT_TOKEN] * max(0, min(self.num_speculative_tokens, limit))


def create_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    if config.method == "draft_model":
        return DraftSlots(config.num_speculative_tokens)
    if config.drafts_on_runner:
        return RunnerDrafts(config.num_speculative_tokens)
    raise ValueError(f"no proposer for method {config.method!r}")   # SpeculativeConfig.parse refuses it first
