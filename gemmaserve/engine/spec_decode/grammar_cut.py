"""Drafts within a request's grammar (structured output): a draft the grammar forbids, and those after it,
are never worth a row of the target's forward, so the runner cuts them before it (`cut_to_grammars`),
and cuts what a drafter proposes after a step likewise (`allowed_drafts`)."""

from __future__ import annotations

import dataclasses

from ..sampler import SamplingState
from ..step import SeqStep


def drafts_of(s: SeqStep, filled: dict[str, list[int]]) -> list[int]:
    """`s`'s drafts: those the drafter filled into its draft slots, else the plan's (n-gram)."""
    return filled.get(s.req_id) or s.token_ids[len(s.token_ids) - s.num_drafts:]


def cut_to_grammars(seqs: list[SeqStep], filled: dict[str, list[int]], sampling: dict[str, SamplingState]
                    ) -> tuple[list[SeqStep], dict[str, list[int]]] | None:
    """`seqs` with each one's drafts up to the first its grammar forbids, and the drafter's filled drafts
    likewise; None if nothing is cut."""
    allowed: dict[str, int] = {}
    for s in seqs:
        state = sampling.get(s.req_id) if s.num_drafts and s.sample else None
        if state is not None and state.grammar is not None:
            n = state.grammar.allowed_prefix(drafts_of(s, filled))
            if n < s.num_drafts:
                allowed[s.req_id] = n
    if not allowed:
        return None
    out, kept = [], dict(filled)
    for s in seqs:
        if s.num_drafts:   # the drafter's slots as the ids it filled in: the inputs are built again
            drafts, n = drafts_of(s, filled), allowed.get(s.req_id, s.num_drafts)
            s = dataclasses.replace(s, token_ids=s.token_ids[:len(s.token_ids) - s.num_drafts] + drafts[:n],
                                    num_drafts=n)
            if s.req_id in kept:
                kept[s.req_id] = drafts[:n]
        out.append(s)
    return out, kept


def allowed_drafts(state: SamplingState | None, drafts: list[int]) -> list[int]:
    """`drafts` up to the first one the request's grammar forbids."""
    if state is None or state.grammar is None:
        return drafts
    return drafts[:state.grammar.allowed_prefix(drafts)]
