"""The fused decode path of Gemma 4's experts (models/moe_kernels.py) in Triton's interpreter, fp32: the same
values as the grouped path (moe.GroupedExperts: sort, grouped products, unsort, sum), a token's bits independent
of the other tokens, and shapes that do not fit refused. On CUDA, `Experts` takes it for steps of up to 8 tokens
(benchmarks/gpu_gemma4 `check` runs the MoE variant through it against eager and the torch backend)."""

import os

import pytest
import torch

from helpers import fresh_seed

pytest.importorskip("triton")
from gemmaserve.models import moe_kernels as MK  # noqa: E402
from gemmaserve.models.moe import Experts, GroupedExperts  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _experts(gen, hidden=72, inter=40, num=12):
    ex = Experts(hidden, inter, num, torch.float32)
    ex.gate_up_proj.copy_(torch.randn(num, 2 * inter, hidden, generator=gen) * hidden ** -0.5)
    ex.down_proj.copy_(torch.randn(num, hidden, inter, generator=gen) * inter ** -0.5)
    return ex


def _route(gen, t, k, num):
    idx = torch.stack([torch.randperm(num, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    return w / w.sum(-1, keepdim=True), idx


@interpreted
@pytest.mark.parametrize("t, k", [(1, 8), (3, 4), (8, 8)])
def test_decode_path_gives_the_grouped_paths_values(t, k):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    ex = _experts(gen)
    x = torch.randn(t, 72, generator=gen)
    w, idx = _route(gen, t, k, 12)
    got = MK.experts_decode(x, w, idx, ex.gate_up_proj, ex.down_proj, 40)
    want = GroupedExperts.forward(ex, x, w, idx)   # the grouped path, whatever the device
    assert got.shape == want.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


@interpreted
def test_a_tokens_bits_do_not_depend_on_the_other_tokens():
    gen = torch.Generator().manual_seed(fresh_seed())
    ex = _experts(gen)
    x = torch.randn(6, 72, generator=gen)
    w, idx = _route(gen, 6, 8, 12)
    full = MK.experts_decode(x, w, idx, ex.gate_up_proj, ex.down_proj, 40)
    for i in (0, 5):
        one = MK.experts_decode(x[i:i + 1], w[i:i + 1], idx[i:i + 1], ex.gate_up_proj, ex.down_proj, 40)
        assert torch.equal(one[0], full[i]), i


def test_eligibility_and_refusals():
    gen = torch.Generator().manual_seed(fresh_seed())
    ex = _experts(gen)
    x = torch.randn(2, 72)
    idx = torch.zeros(2, 8, dtype=torch.long)
    assert not MK.decode_eligible(x, torch.zeros(9, 8, dtype=torch.long))   # 72 pairs: the grouped path
    assert not MK.decode_eligible(x, torch.zeros(0, 8, dtype=torch.long))
    assert MK.decode_eligible(x, idx) == (os.environ.get("TRITON_INTERPRET") == "1")   # CUDA, or the interpreter
    with pytest.raises(ValueError, match="do not fit"):
        MK.experts_decode(x, torch.ones(2, 8), idx, ex.gate_up_proj, ex.down_proj, 41)
    with pytest.raises(ValueError, match="unit stride"):
        MK.experts_decode(x.t().contiguous().t(), torch.ones(2, 8), idx, ex.gate_up_proj, ex.down_proj, 40)
