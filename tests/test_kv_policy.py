"""Group policies (kv/policy.py) against brute force, and the manager under speculative steps: k+1
positions allocated, fewer committed, rejected drafts never cached."""

from __future__ import annotations

import random

import pytest

from gemmaserve.kv.groups import KVGroup
from gemmaserve.kv.manager_v2 import KVCacheManagerV2
from gemmaserve.kv.policy import NEVER, FullAttentionPolicy, SlidingWindowPolicy, policy_for
from gemmaserve.kv.spec import AttentionKind

from helpers import fresh_seed
from test_kv_admission import _specs


def _visible_from(policy, position: int, lookback: int) -> int:
    """Brute force: the first key any query at position - lookback or later reads."""
    g = policy.group
    if g.window is None:
        return 0
    return max(0, position - lookback - g.window + 1)


@pytest.mark.parametrize("window", [None, 1, 5, 16, 33])
@pytest.mark.parametrize("tokens_per_page", [1, 4, 16])
@pytest.mark.parametrize("lookback", [0, 3])
def test_policy_answers_equal_brute_force(window, tokens_per_page, lookback):
    kind = AttentionKind.FULL if window is None else AttentionKind.SLIDING
    policy = policy_for(KVGroup(0, kind, window, tokens_per_page, (0, 1)), lookback)
    assert isinstance(policy, FullAttentionPolicy if window is None else SlidingWindowPolicy)
    t = tokens_per_page
    for p in range(0, 200):
        first = _visible_from(policy, p, 0 if window is None else lookback) // t
        assert policy.first_needed_block(p) == first, p
        assert policy.hit_blocks(p) == range(first, p // t)
        assert policy.needed_blocks(p) == range(first, -(-p // t))
        # next_drop: the next position where the first needed block moves on (NEVER for full attention)
        later = next((q for q in range(p + 1, p + 200) if policy.first_needed_block(q) > first), NEVER)
        assert policy.next_drop(p) == later, p
        # step_blocks: what the step [p, p + 7) holds: the blocks its first query reads, then the new ones
        # rollback_floor: the lowest position whose query finds every block of a table starting at block first
        floor = next(q for q in range(0, 10 * 200) if policy.first_needed_block(q) >= first)
        assert policy.rollback_floor(first) == floor, p
        b = policy.step_blocks(p, p + 7, None)
        assert (b.held_before, b.new, b.scratch) == (-(-p // t) - first, -(-(p + 7) // t) - -(-p // t), 0)
    assert not policy_for(KVGroup(0, AttentionKind.FULL, None, t, (0,))).drops_blocks
    with pytest.raises(ValueError, match="lookback"):
        SlidingWindowPolicy(KVGroup(0, AttentionKind.SLIDING, 8, t, (0,)), lookback=-1)


@pytest.mark.parametrize("lookback", [0, 4])
@pytest.mark.parametrize("scratch", [False, True])
def test_speculative_steps_commit_only_accepted_tokens(lookback, scratch):
    """Each step allocates the last sampled token and k drafts, then commits only what was accepted:
    the tables stay complete for the next query (and `lookback` more tokens), the pool balances, and
    the prefix cache only ever holds blocks of accepted tokens, so another sequence with the same
    final tokens hits exactly the committed, block-aligned prefix."""
    rng = random.Random(fresh_seed())
    window, page, k = 9, 2, 4
    kv = KVCacheManagerV2(_specs(window, 1), page, 10_000, enable_prefix_caching=True, enable_scratch=scratch,
                          lookback=lookback)
    tokens = [rng.randrange(3, 999) for _ in range(23)]
    assert kv.allocate("s", tokens, 0, len(tokens) - 1, prefill=True)
    kv.commit("s", tokens, len(tokens) - 1)
    for _ in range(40):
        start = len(tokens) - 1   # the last sampled token is not computed yet
        drafts = [rng.randrange(3, 999) for _ in range(k)]
        proposed = tokens + drafts
        assert kv.allocate("s", proposed, start, start + k + 1, prefill=False)
        accepted = rng.randrange(0, k + 1)   # drafts accepted; the target's own token follows them
        tokens = proposed[:start + 1 + accepted] + [rng.randrange(3, 999)]   # a bonus token, never a draft
        kv.commit("s", tokens, start + 1 + accepted)
        kv.check_integrity()
        computed = start + 1 + accepted
        for policy, (first, n) in zip(kv.policies, kv.held_blocks("s")):
            reads = _visible_from(policy, computed, lookback) // page
            assert first <= reads and first + n >= policy.group.num_blocks(computed)
    hit = kv.lookup("t", tokens)
    computed = len(tokens) - 1
    assert hit == computed - computed % kv._hit_step   # every committed block edge of every group, none past it
    assert kv.allocate("t", tokens, hit, len(tokens), prefill=True)
    kv.check_integrity()
