"""A proposer that drafts a known continuation at a set acceptance rate (benchmarks and tests of verification).

Random weights accept nothing a real drafter would guess, so a benchmark of speculative decoding on them
cannot measure acceptance; it can set it. The target's greedy continuation of each prompt is first
generated without drafts; this proposer then drafts the next k tokens of that continuation, each one
right with probability `acceptance` (drawn per request and position, so a run is reproducible) and
otherwise a token the continuation does not have there. The target accepts a draft exactly when it is
right and every draft before it was, so steps emit 1 + a + ... + a^k tokens on average, through the
engine's whole path (scheduling, verification, rollback), and the output stays the target's own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class ReplayDrafts:
    num_speculative_tokens: int
    continuations: dict[tuple[int, ...], list[int]]   # prompt ids -> the target's greedy continuation
    acceptance: float
    vocab_size: int
    seed: int = 0
    drafts_after_step = False   # the scheduler asks when it plans a step (no model runs for it)

    def propose(self, req, limit: int) -> list[int]:
        prompt = tuple(req.prompt_token_ids)
        known = self.continuations.get(prompt)
        if known is None:
            return []
        done = len(req.output_token_ids)
        rng = random.Random(f"{self.seed}:{len(prompt)}:{prompt[-8:]}:{done}")
        drafts = []
        for i in range(min(self.num_speculative_tokens, limit)):
            right = known[done + i] if done + i < len(known) else None
            if right is not None and rng.random() < self.acceptance:
                drafts.append(right)
            else:   # a miss: any other token (the target would not have chosen it)
                wrong = rng.randrange(3, self.vocab_size - 1)
                drafts.append(wrong + 1 if wrong == right else wrong)
        return drafts
