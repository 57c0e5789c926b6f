"""The figures `bench quality` and the GPU benches report (testing/scoring.py): greedy agreement,
perplexity over several passages, and the paired log-likelihood difference."""

import math

import pytest
import torch

from gemmaserve.testing.scoring import Scorer, Scores, first_divergence, greedy_totals, paired_nll_difference
from helpers import fresh_seed, ours_from_hf, tiny_hf_model


def test_first_divergence_counts_the_shared_prefix():
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([5, 2], [1, 2]) == 0
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 2], [1, 2, 3]) == 2   # one stopped early: its length


def test_greedy_totals_sum_tokens_and_keep_the_largest_margin_overridden():
    rows = [{"a": {"tokens_until_divergence": 4, "ref_margin_there": 0.2},
             "b": {"tokens_until_divergence": 8, "ref_margin_there": None}},
            {"a": {"tokens_until_divergence": 8, "ref_margin_there": None},
             "b": {"tokens_until_divergence": 1, "ref_margin_there": 0.05}},
            {"a": {"tokens_until_divergence": 0, "ref_margin_there": 0.4},
             "b": {"tokens_until_divergence": 8, "ref_margin_there": None}}]
    totals = greedy_totals(rows, ["a", "b"], new_tokens=8)
    assert totals["a"] == {"tokens_until_divergence": 12, "of": 24, "diverged": 2, "largest_margin_overridden": 0.4}
    assert totals["b"] == {"tokens_until_divergence": 17, "of": 24, "diverged": 1, "largest_margin_overridden": 0.05}
    never = greedy_totals(rows[1:2], ["a"], new_tokens=8)["a"]
    assert never["diverged"] == 0 and never["largest_margin_overridden"] is None


def test_one_scorer_serves_many_passages_as_fresh_ones_do():
    """`bench quality` scores every passage through one Scorer (one KV pool, one compiled step):
    each passage must score as if alone (its KV freed after it, nothing carried to the next)."""
    hf = tiny_hf_model(fresh_seed())
    ours = ours_from_hf(hf)
    gen = torch.Generator().manual_seed(fresh_seed())
    texts = [[2] + torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (37, 21, 37)]
    scorer = Scorer(ours, max_len=40, chunk=8)
    free = scorer.kv.num_free_pages
    for ids in texts:
        alone = Scorer(ours, max_len=len(ids), chunk=8).score(ids)
        shared = scorer.score(ids)
        assert torch.equal(shared.logprobs, alone.logprobs) and torch.equal(shared.argmax, alone.argmax)
        assert scorer.kv.num_free_pages == free
    with pytest.raises(ValueError, match="at most 40"):
        scorer.score(texts[0] + texts[1])


def _scores(logprobs: list[float]) -> Scores:
    lp = torch.tensor(logprobs)
    return Scores(lp, torch.zeros(len(lp), dtype=torch.long), torch.ones(len(lp)), kl=-lp / 10)


def test_passages_join_into_one_token_weighted_perplexity():
    a, b = _scores([-1.0, -2.0, -3.0]), _scores([-0.5])
    joined = Scores.cat([a, b])
    assert joined.logprobs.tolist() == [-1.0, -2.0, -3.0, -0.5]
    # every token counts once: not the mean of the two passages' perplexities
    assert joined.perplexity == pytest.approx(math.exp(6.5 / 4))
    assert joined.mean_kl == pytest.approx(0.65 / 4)
    assert Scores.cat([a, Scores(b.logprobs, b.argmax, b.margin)]).kl is None   # one passage without KL: none


def test_paired_nll_difference_is_the_log_perplexity_ratio_with_its_error():
    a, b = _scores([-1.0, -2.0, -3.0, -2.0]), _scores([-1.5, -2.0, -2.5, -2.2])
    mean, se = paired_nll_difference(a, b)
    assert mean == pytest.approx(math.log(a.perplexity / b.perplexity))
    d = torch.tensor([-0.5, 0.0, 0.5, -0.2], dtype=torch.float64)   # a's NLL minus b's, per token
    assert mean == pytest.approx(float(d.mean())) and se == pytest.approx(float(d.std() / 2))
    assert paired_nll_difference(a, a) == (0.0, 0.0)
    with pytest.raises(ValueError, match="different texts"):
        paired_nll_difference(a, _scores([-1.0]))
