"""Draft proposers for speculative decoding: guesses at a sequence's next tokens, which the target
checks in one forward (spec_decode.py). A wrong guess costs compute, never output.

    ngram (prompt lookup)   the tokens that followed the latest earlier occurrence of the sequence's last
                            n tokens, for n from prompt_lookup_max down to prompt_lookup_min: no model,
                            pays where the output copies its input (edits, extraction, summaries)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..config.speculative import SpeculativeConfig


class Proposer(Protocol):
    num_speculative_tokens: int

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """At most `limit` (and at most num_speculative_tokens) guesses at the tokens after `token_ids`."""


@dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int
    max_n: int
    min_n: int

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
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


def create_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    raise ValueError(f"no proposer for method {config.method!r}")   # SpeculativeConfig.parse refuses it first
