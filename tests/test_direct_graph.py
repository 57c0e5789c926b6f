"""A compiled graph called without Dynamo (engine/compile/direct_graph.py): its inputs laid out from the call's
tensors and the objects the trace held, and its shape guards enforced."""

import pytest
import torch
from torch import nn

from gemmaserve.engine.compile.compiled_decode import unavailable
from gemmaserve.engine.compile.direct_graph import DirectGraph

from helpers import fresh_seed

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))
        self.scale = torch.tensor(0.5)   # a plain tensor attribute, as the quantised kernels hold theirs

    def step(self, x: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [2, 4] static; table [3, W] with W dynamic: a sum over it, and its width as a size
        y = (x @ self.weight.t()) * self.scale
        return y + table.sum(1).sum(), y.new_zeros(table.shape[1]) + table.shape[1]


def _captured(toy: _Toy, call: tuple[torch.Tensor, ...]):
    """Compile `toy.step` with a backend that captures, on `call`; (DirectGraph, Dynamo's result)."""
    from torch._inductor.compile_fx import compile_fx

    seen = {}

    def backend(gm, example_inputs):
        fn = compile_fx(gm, example_inputs)
        seen["direct"] = DirectGraph.capture(gm, example_inputs, fn, call)
        return fn

    torch._dynamo.reset()
    compiled = torch.compile(toy.step, backend=backend, dynamic=False, fullgraph=True)
    torch._dynamo.mark_dynamic(call[1], 1, min=2, max=64)
    with torch.inference_mode():
        result = compiled(*call)
    return seen["direct"], result


def test_direct_call_matches_the_function_and_rejects_what_its_guards_do():
    torch.manual_seed(fresh_seed())
    toy = _Toy()
    x, table = torch.randn(2, 4), torch.randn(3, 7)
    direct, result = _captured(toy, (x, table))
    assert isinstance(direct, DirectGraph), direct
    assert sorted(d for _, _, d in direct.feeds if d is not None) == [1]   # W, read off the table
    with torch.inference_mode():
        assert direct.verify((x, table), result)
        for width in (2, 5, 40):   # the dynamic width: any in its range, no new trace
            x2, t2 = torch.randn(2, 4), torch.randn(3, width)
            out = direct((x2, t2))
            want = toy.step(x2, t2)
            assert torch.allclose(out[0], want[0], atol=1e-5) and torch.equal(out[1], want[1])
        toy.weight.data.mul_(2)   # held objects are the module's own tensors, not copies
        assert torch.allclose(direct((x, table))[0], toy.step(x, table)[0], atol=1e-5)
        # what the trace assumed: x's static shape, the table's row count, W's range, the dtypes
        assert direct((torch.randn(3, 4), table)) is None
        assert direct((x, torch.randn(4, 7))) is None
        assert direct((x, torch.randn(3, 65))) is None
        assert direct((x.double(), table)) is None
        assert direct((torch.randn(4, 2).t(), table)) is None   # other strides


def test_verify_refuses_a_direct_call_that_returns_other_tensors():
    toy = _Toy()
    x, table = torch.randn(2, 4), torch.randn(3, 7)
    direct, result = _captured(toy, (x, table))
    with torch.inference_mode():
        assert not direct.verify((x, table), (result[1], result[0]))   # outputs in another order
        assert not direct.verify((x, table), (result[0] + 1e-3, result[1]))
        assert not direct.verified
        assert direct.verify((x, table), result) and direct.verified


def test_capture_declines_a_call_tensor_the_graph_does_not_take():
    toy = _Toy()
    x, table = torch.randn(2, 4), torch.randn(3, 7)
    unused = torch.zeros(1)
    from torch._inductor.compile_fx import compile_fx

    seen = {}

    def backend(gm, example_inputs):
        fn = compile_fx(gm, example_inputs)
        seen["direct"] = DirectGraph.capture(gm, example_inputs, fn, (x, table, unused))
        return fn

    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(toy.step, backend=backend, dynamic=False, fullgraph=True)(x, table)
    assert seen["direct"] == "not every call tensor is a graph input"
