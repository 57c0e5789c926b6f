"""Verification of drafted tokens: keep the output of one token per step, exactly.

A speculative sequence arrives with logits for k + 1 positions: after its last real token and after
each of its k drafts. Position by position, the target samples its own token there, exactly as a step
of its own would (same filters, penalties, grammar mask, random generator); if that token is the draft,
the draft is accepted and the next position is checked, else the target's token is emitted and the
rest is dropped. After k accepted drafts the last position gives one more token.

    drafts      d1  d2  d3
    target      d1  d2  x      -> emits d1 d2 x (x != d3; d3's position is computed again next step)

Greedy requests therefore emit the same tokens as without drafts. So do random ones, and with the same
seed: a draft is deterministic (one token with probability 1), so "accept with probability p(d), else
draw from p without d" (rejection sampling) is the same as drawing from p and comparing, which is what
happens here, one draw per emitted token, as without drafts. Penalties count and grammars accept only
emitted tokens, so nothing needs rolling back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...device import to_device
from ..request import TokenLogprob
from ..sampler import SamplingState, sample
from ..step import SeqStep, StepResult
from ..structured.structured_output import Grammars
from .grammar_cut import drafts_of


@dataclass
class Verified:
    tokens: list[list[int]]                         # per sequence: 1..k + 1 emitted tokens
    logprobs: list[list[TokenLogprob | None]]


def verify(logits: torch.Tensor, num_rows: list[int], drafts: list[list[int]], states: list[SamplingState],
           grammars: Grammars | None = None, row_by_row: bool = False) -> Verified:
    """`logits`: [sum(num_rows), V], sequence b's rows consecutive (num_rows[b] = len(drafts[b]) + 1).
    Reads every position's choice back to the host: a draft is accepted only if the target agrees."""
    n = len(num_rows)
    starts = [sum(num_rows[:b]) for b in range(n)]
    out = Verified([[] for _ in range(n)], [[] for _ in range(n)])
    active = list(range(n))
    for pos in range(max(num_rows)):
        if not active:
            break
        rows = to_device([starts[b] + pos for b in active], torch.long, logits.device)
        step = sample(logits[rows], [states[b] for b in active], grammars, row_by_row=row_by_row)
        chosen, records = step.resolve()
        still = []
        for j, b in enumerate(active):
            out.tokens[b].append(chosen[j])
            out.logprobs[b].append(records[j])
            if pos < len(drafts[b]) and chosen[j] == drafts[b][pos]:
                still.append(b)   # the draft was right: its successor's position is valid too
        active = still
    return out


def verify_step(logits: torch.Tensor, seqs: list[SeqStep], filled: dict[str, list[int]],
                sampling: dict[str, SamplingState], grammars: Grammars | None, row_by_row: bool) -> StepResult:
    """A step's result where sequences carry drafts: each one's emitted tokens (`filled`: the drafts a
    drafter put in draft slots; the others are the plan's)."""
    got = verify(logits, [s.num_drafts + 1 for s in seqs], [drafts_of(s, filled) for s in seqs],
                 [sampling[s.req_id] for s in seqs], grammars, row_by_row=row_by_row)
    result = StepResult()
    for s, tokens, logprobs in zip(seqs, got.tokens, got.logprobs):
        result.req_ids += [s.req_id] * len(tokens)
        result.token_ids += tokens
        result.logprobs += logprobs
    return result
