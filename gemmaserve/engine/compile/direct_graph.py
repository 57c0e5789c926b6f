"""A compiled decode graph called without TorchDynamo in the way.

Each call of a `torch.compile`d function runs Dynamo's frame evaluation: its guards, then bytecode that
reads every graph input from the Python objects it came from (~400 attribute chains for the 270M:
each weight, scale and packed matrix), then the graph. That costs ~0.5 ms of a ~13 ms CPU decode
step, for inputs that never change: the weights are fixed once loaded (compiled_decode.py already
skips Dynamo's guards on them). So the backend below hands the graph to inductor as Dynamo's own
would, and keeps what it needs to call the compiled graph itself:

    placeholder   0     1      2     ...  16    17        ...  400
    source        kv    ids    pos   ...  s32   keys[0]   ...  the head's scales
    fed from      call  call   call       keys[0].size(2)      held (a weight)

The call's tensors fill their slots each step, a symbolic size is read off the tensor it came from,
and every other slot holds the object Dynamo saw when tracing. Before the graph runs, the shape
guards the trace and inductor made about the call's tensors (sizes, strides, the symbols' ranges)
are evaluated; a call they reject goes through Dynamo as before. `verify` checks once, on the
warm-up batch, that the direct call returns what the Dynamo call returned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


@dataclass
class DirectGraph:
    """An inductor graph with its inputs laid out: `held[i]` where the slot holds an object, else the
    slot is fed from the call (`feeds`: slot -> (call tensor, dim or None for the tensor itself))."""

    fn: Callable[..., Sequence[torch.Tensor]]
    held: list[Any]
    feeds: list[tuple[int, int, int | None]]   # (slot, index of the call's tensor, dim)
    dtypes: tuple[torch.dtype, ...]            # of the call's tensors
    guards: "_Guards | None"                   # the shape guards on the fed slots
    verified: bool = False

    @classmethod
    def capture(cls, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], fn: Callable,
                call: Sequence[torch.Tensor]) -> "DirectGraph | str":
        """Lay out `gm`'s placeholders, given the tensors of the call being traced (`call`, in the
        order later calls pass them). Returns why not where the layout is not understood."""
        slots = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(slots) != len(example_inputs):
            return "placeholders and inputs differ in number"
        by_id = {id(t): i for i, t in enumerate(call)}
        held: list[Any] = list(example_inputs)
        feeds: list[tuple[int, int, int | None]] = []
        fakes: list[Any] = []   # example values of the fed slots, for the guards
        symbols: dict[Any, tuple[int, int]] = {}   # sympy symbol -> (call tensor, dim)
        for slot, (node, value) in enumerate(zip(slots, example_inputs)):
            if id(value) in by_id:
                i = by_id[id(value)]
                fake = node.meta.get("example_value")
                if not isinstance(fake, torch.Tensor):
                    return f"no example value for {node.name}"
                for d, size in enumerate(fake.shape):
                    if isinstance(size, torch.SymInt):
                        symbols.setdefault(size.node.expr, (i, d))
                feeds.append((slot, i, None))
                fakes.append(fake)
                held[slot] = None
        for slot, (node, value) in enumerate(zip(slots, example_inputs)):
            if isinstance(value, torch.SymInt):
                where = symbols.get(node.meta["example_value"].node.expr)
                if where is None:
                    return f"symbolic size {node.name} is not a size of the call's tensors"
                feeds.append((slot, *where))
                fakes.append(node.meta["example_value"])
                held[slot] = None
        if len({i for _, i, d in feeds if d is None}) != len(call):
            return "not every call tensor is a graph input"
        guards = None
        shape_env = next((f.node.shape_env for f in fakes if isinstance(f, torch.SymInt)), None)
        if shape_env is None:
            shape_env = next((f.fake_mode.shape_env for f in fakes if isinstance(f, torch.Tensor)
                              and getattr(f, "fake_mode", None) is not None), None)
        if shape_env is not None:
            code = shape_env.produce_guards_expression(fakes, ignore_static=False)
            if code:
                names = [f"t{i}" for i in range(len(fakes))]
                guards = _Guards(code, compile(code, "<decode graph guards>", "eval"), names)
        return cls(fn, held, feeds, tuple(t.dtype for t in call), guards)

    def __call__(self, call: Sequence[torch.Tensor]) -> Sequence[torch.Tensor] | None:
        """The graph's outputs for these call tensors, or None if its guards reject them."""
        if tuple(t.dtype for t in call) != self.dtypes:
            return None
        args = list(self.held)
        values = []
        for slot, i, dim in self.feeds:
            value = call[i] if dim is None else call[i].size(dim)
            args[slot] = value
            values.append(value)
        if self.guards is not None and not self.guards(values):
            return None
        return self.fn(*args)

    def verify(self, call: Sequence[torch.Tensor], expected: Sequence[torch.Tensor | None]) -> bool:
        """Whether this direct call returns `expected` (the Dynamo call's tensors on the same
        inputs, in order), exactly. A call that raises is no match."""
        try:
            out = self(call)
        except Exception:
            out = None
        want = [t for t in expected if t is not None]
        self.verified = out is not None and len(out) == len(want) and all(
            a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(out, want))
        return self.verified


@dataclass(frozen=True)
class _Guards:
    """`ShapeEnv.produce_guards_expression`'s expression over the fed values (`t0`, `t1`, ...),
    compiled once (its `evaluate_guards_expression` compiles the text on every call)."""

    text: str
    code: Any   # `text` compiled
    names: list[str]

    def __call__(self, values: list) -> bool:
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        return bool(eval(self.code, SYMPY_INTERP, {"L": dict(zip(self.names, values))}))
