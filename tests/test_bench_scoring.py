"""The greedy-agreement figures `bench quality` and the GPU benches report (bench/scoring.py)."""

from gemmaserve.bench.scoring import first_divergence, greedy_totals


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
