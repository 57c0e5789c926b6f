"""Speculative decoding: who proposes drafts and how they are verified.

    proposers.py     the scheduler's side: n-gram lookup, or a drafter the runner runs (`create_proposer`)
    drafters.py      the runner's side of a drafter (the interface draft_model.py and mtp.py implement)
    draft_model.py   a smaller Gemma as the drafter, its KV layers in the target's pool
    mtp.py           Gemma 4's MTP drafter over the target's KV
    build.py         the drafters built from the speculative config, checked against the target
    verify.py        accept/reject drafts against the target's logits (rejection sampling), a step's result
    grammar_cut.py   drafts cut to what a request's grammar allows, before the forward and after a drafter

The scheduler sees only "k more tokens for this request"; the runner verifies and keeps the drafter's state.
"""
