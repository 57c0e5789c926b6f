"""Sampling filters: temperature, top-k, top-p semantics."""

import torch

from gemmaserve.engine.sampler import filtered_probs


def test_top_k_keeps_exactly_k():
    logits = torch.randn(3, 100)
    probs = filtered_probs(logits, torch.ones(3), [5, 0, 1], torch.ones(3))
    assert (probs[0] > 0).sum() == 5 and (probs[1] > 0).sum() == 100 and (probs[2] > 0).sum() == 1
    assert torch.equal(probs[0].topk(5).indices.sort().values, logits[0].topk(5).indices.sort().values)
    assert torch.allclose(probs.sum(-1), torch.ones(3))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for p, kept in ((0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.96, 4), (1.0, 4)):
        probs = filtered_probs(logits, torch.ones(1), [0], torch.tensor([p]))
        assert (probs > 0).sum().item() == kept, p


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = filtered_probs(logits, torch.tensor([0.5]), [0], torch.ones(1))
    hot = filtered_probs(logits, torch.tensor([2.0]), [0], torch.ones(1))
    assert cold[0, 0] > torch.softmax(logits, -1)[0, 0] > hot[0, 0]
