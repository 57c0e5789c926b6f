"""Compiled decode steps on the CPU: the model's forward as one torch.compile graph (inductor's C++ kernels).

An eager CPU decode step runs ~1,500 small torch ops between its matrix products (norms, RoPE,
casts, rotations, residual adds), ~10 ms of a 25 ms step on the 270M. Compiled, the elementwise work
fuses into a few C++ loops and the Python between the ops is gone; the matrix products stay what they
were (fbgemm through custom ops, models/quant.py). Attention is traced too where the KV
cache is one arena of one geometry (attention/traced.py: the cache and the step's tables are graph
inputs, the new K/V come out of the graph and are written after it); elsewhere (KV manager V1, an fp8
cache) the graph calls the step's eager attention through an opaque op (attention/handle.py).
Inductor writes the code that calls the kernels in C++ where the graph takes no Python objects, and
once compiled a graph is called without Dynamo's frame evaluation (direct_graph.py).

    decode step, B = 1     a graph for 1 row (static shapes)
    decode step, B = 8     a graph for 8 rows (static)
    decode step, other B   one graph whose batch dimension is dynamic (2-63; padding a batch of 5-7
                           up to the 8-row graph cost 9-20% more on the 270M:
                           benchmarks/compiled_rows.py)
    every other step       eager (prefill chunks, mixed steps, images, B >= 64)

Compiling the three graphs took 4-8 min on 2 cores the first time, 26-31 s with inductor's cache warm,
in the engine's own process: not on a background thread beside eager steps, as tracing holds the GIL
and every torch op of an eager step gives it up and waits up to the switch interval for it back
(measured: 25 ms steps became 1 s). So the engine's compiled steps are now the exported packages of
aot_decode.py, built by another process and kept; this in-process compile is what `--cpu-compile on`
runs where a step cannot be exported (KV manager V1, an fp8 cache, fbgemm's packed objects without
VNNI), and what `bench quality`'s scorer runs. The numerically sensitive work is in custom ops the
graph calls as they are (models/cpu_kernels.py): a compiled step gives the eager step's bits. Warm-up
calls write only the null page (the extra page the runner allocates; no sequence reads it). A failed
compile leaves the engine eager and says why.
"""

from __future__ import annotations

import enum
import logging
import time
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ... import opaque
from ...attention.base import AttentionBackend, AttentionMetadata
from ...attention.handle import AttentionHandle, HandleAttention
from ...attention.traced import MIN_WIDTH, DecodeLayout, DecodeTables, TracedDecodeAttention
from ...kv.base import GroupTables
from ...kv.spec import LayerSpec
from ...models import cpu_library
from ...models.base import ModelInputs
from .direct_graph import DirectGraph

log = logging.getLogger(__name__)

# Decode batches of more rows run eagerly (a graph for them would be one more compile: rare, large batches).
# The dynamic graph is traced for 2..MAX_ROWS rows whatever the engine's largest batch: inductor's caches
# key a graph without its dimensions' ranges, so an engine of another largest batch would load a graph
# whose guards hold only to that batch (the exported packages of aot_decode.py use the same range).
MAX_ROWS = 63
# Graphs compiled for exactly this many rows; a batch of another size runs the graph whose batch
# dimension is dynamic (padding up costs more than the static shapes save: BENCHMARKS.md, issue 30).
STATIC_SIZES = (1, 8)
# Inductor's options for the graphs. cpp_wrapper: the code that calls the kernels is C++, not Python
# (12.2 vs 12.8 ms a batch-1 step of the 270M). The Python wrapper, where a graph takes Python objects
# (below), checks each op's output sizes and alignment by default: ~500 checks a step, on shapes the
# trace already proved.
INDUCTOR_OPTIONS = {"cpp_wrapper": True, "size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


class CompileState(enum.Enum):
    WAITING = "waiting"
    READY = "ready"
    FAILED = "failed"


def unavailable() -> str | None:
    """Why this process cannot compile CPU decode steps, or None if it can (inductor also needs a
    C++ compiler: without one the compile fails and says so)."""
    if not opaque.SUPPORTED:
        return f"torch {torch.__version__} has no opaque objects (needs >= 2.10)"
    return None


def _own_code(method):
    """`method` as a function with a code object of its own. torch.compile keeps graphs per code
    object and, with the module guards off, would run one engine's graph on another engine's model
    (another structure) when both compiled the same method."""
    fn = method.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(own, method.__self__)


@dataclass(eq=False)
class _DecodeStep:
    """The traced function's object: what a step reads (the attention op's handle's, or the traced layout). Its
    names are those the traced method of CompiledDecode had: graph inputs are named after them (inductor's cache keys)."""

    model: nn.Module
    _attention: HandleAttention
    layout: DecodeLayout | None

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor | None = None,
              keys: list[torch.Tensor] | None = None, state: list[torch.Tensor] | None = None):
        """Logits, hidden states (a drafter reads them), and the new K/V to commit when attention is
        traced (where it runs through the op, the op wrote them)."""
        if kv is None:
            hidden = self.model(ModelInputs(input_ids, positions, self._attention))
            return self.model.compute_logits(hidden), hidden
        attention = TracedDecodeAttention(self.layout, kv, keys, state)
        hidden = self.model(ModelInputs(input_ids, positions, attention))
        return self.model.compute_logits(hidden), hidden, attention.new_kv()


def _weak_backend(compiled: "CompiledDecode") -> Callable:
    """Dynamo's backend for `compiled`'s graphs, holding it weakly (see CompiledDecode.__init__)."""
    backend = weakref.WeakMethod(compiled._backend)

    def call(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        return backend()(gm, example_inputs)

    return call


class CompiledDecode:
    def __init__(self, model: nn.Module, backend: AttentionBackend, kv_cache, layer_slot, groups,
                 null_page: int, max_batch: int, specs: list[LayerSpec] | None = None,
                 tokens_per_page: tuple[int, ...] = ()):
        """`specs` and `tokens_per_page` (the KV layout's): to trace attention when the cache allows
        (attention/traced.py); without them, or where it does not, attention runs through the op."""
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.layer_slot = layer_slot
        self.groups = groups
        self.null_page = null_page
        layout = DecodeLayout.of(specs, kv_cache, layer_slot, tokens_per_page, null_page) if specs else "no layer specs"
        self.layout = layout if isinstance(layout, DecodeLayout) else None
        self.attention_path = "traced" if self.layout else f"opaque op ({layout})"
        self.max_rows = min(MAX_ROWS, max_batch)
        self.sizes = sorted({min(s, self.max_rows) for s in STATIC_SIZES})   # static graphs, by rows
        self.dynamic = any(self._size_for(b) is None for b in range(2, self.max_rows + 1))
        self.handle = AttentionHandle()
        self._attention = HandleAttention(self.handle)
        # The weights never change after loading: guarding on every module's parameters cost ~1.4 ms
        # a step (they are graph inputs either way). Steps whose graph was captured skip Dynamo
        # altogether (direct_graph.py).
        dynamo = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        # Static shapes where they matter most: inductor's kernels for a symbolic batch ran an 8-row
        # step ~25% slower than the same graph compiled for 8 rows.
        # Neither the traced step nor the backend is a method of this object: the compiled functions (held here)
        # hold both, and Dynamo keeps every backend for the process's life (torch._dynamo.eval_frame.cached_backends),
        # which would keep the model and KV cache after the engine is gone.
        step, backend = _DecodeStep(model, self._attention, self.layout), _weak_backend(self)
        self._static = torch.compile(_own_code(step._step), dynamic=False, backend=backend, options=dict(dynamo))
        self._dynamic = torch.compile(_own_code(step._step), backend=backend, options=dict(dynamo))
        self._direct: dict[int | None, DirectGraph | str] = {}   # by static size (None: dynamic), or why not
        self._tracing: tuple[int | None, tuple[torch.Tensor, ...]] | None = None   # the call being traced
        self.state = CompileState.WAITING
        self.error: str | None = None
        self.compile_seconds = 0.0
        self.refused_recompiles = 0   # decode steps run eagerly because their batch needed a new graph

    # -- compiling ------------------------------------------------------------------------------
    def compile(self) -> None:
        """Trace and compile every graph (once); raises, with the engine left eager, if that fails."""
        if self.state is CompileState.WAITING:
            log.info("compiling CPU decode steps (%d graphs, attention %s): minutes the first time on a small CPU, "
                     "seconds once inductor's cache holds them; --cpu-compile off skips it",
                     len(self.sizes) + self.dynamic, self.attention_path)
            start = time.perf_counter()
            why = cpu_library.load()   # before tracing: the graphs then call the ops' C++ kernels
            if why is not None:
                log.info("compiled steps call the CPU ops' Python kernels: %s", why)
            try:
                with torch.inference_mode():
                    for size in self.sizes:
                        self._warm_up(size, dynamic=False)
                    if self.dynamic:
                        self._warm_up_dynamic()
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
                self.state = CompileState.FAILED
            else:
                self.compile_seconds = time.perf_counter() - start
                self.state = CompileState.READY
                log.info("compiled CPU decode steps in %.1f s", self.compile_seconds)
        if self.state is CompileState.FAILED:
            raise RuntimeError(f"compiling the CPU decode step failed: {self.error}")

    def _warm_up(self, size: int, dynamic: bool) -> None:
        """Trace and compile the graph for `size` rows (`dynamic`: for any from 2 to MAX_ROWS) on a
        batch of the null page."""
        ids = torch.zeros(size, dtype=torch.long)
        pos = torch.zeros(size, dtype=torch.long)
        if dynamic:
            for t in (ids, pos):
                torch._dynamo.mark_dynamic(t, 0, min=2, max=MAX_ROWS)
        self._run(ids, pos, self._null_batch(size), size, compiling=dynamic)

    def _warm_up_dynamic(self) -> None:
        """The dynamic graph's warm-up; once more without inductor's caches where a cached graph's guards
        narrow the batch range (one that an older build of the step compiled for fewer rows: the caches'
        keys hold no ranges)."""
        guards = logging.getLogger("torch._guards")   # logs the violation at ERROR before raising it
        level = guards.level
        guards.setLevel(logging.CRITICAL)
        try:
            self._warm_up(2, dynamic=True)
        except Exception as e:
            if "ConstraintViolationError" not in f"{type(e).__name__}: {e}":
                raise
            log.info("inductor's cache holds this decode graph for a narrower batch range; compiling it afresh")
            with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings():
                warnings.simplefilter("ignore")   # "dynamo_pgo force disabled": what was asked
                self._warm_up(2, dynamic=True)
        finally:
            guards.setLevel(level)

    def _size_for(self, b: int) -> int | None:
        """The static graph a batch of `b` rows runs, or None: the dynamic one."""
        return b if b in self.sizes else None

    def _null_batch(self, size: int) -> AttentionMetadata:
        """`size` one-token sequences at position 0 whose every page is the null page."""
        groups = [GroupTables(g, [0] * size, [1] * size, torch.zeros(size, 1, dtype=torch.long),
                              torch.full((1, g.num_layers), self.null_page, dtype=torch.int32))
                  for g in self.groups]
        return AttentionMetadata([1] * size, [1] * size, groups, self.layer_slot)

    # -- running --------------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits [B, V], hidden states [B, H]) of a decode batch (one token per sequence, every row
        sampled) through the compiled graph, or None when there is none for it yet (the caller runs the
        step eagerly)."""
        b = input_ids.shape[0]
        if self.state is not CompileState.READY or not 1 <= b <= self.max_rows:
            return None
        try:
            # A batch the graphs' guards reject would compile again, for seconds to minutes inside a
            # step while every request waits: run that step eagerly instead, and say so once.
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._run(input_ids, positions, metadata, b)
        except RuntimeError as e:
            if "fail_on_recompile" not in str(e):
                raise
            self.refused_recompiles += 1
            if self.refused_recompiles == 1:
                log.warning("a decode batch of %d rows needs a new graph; such steps run eagerly: %s", b, e)
            return None

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, b: int,
             compiling: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden) of one step of `b` real rows through the graph for `len(input_ids)` rows. `compiling`: the
        dynamic graph's first call, whose traced widths (and batch) are marked dynamic."""
        size = input_ids.shape[0]
        key = size if size in self.sizes and not compiling else None
        if self.layout is None:
            self.handle.batch, self.handle.rows = self.backend.begin_batch(metadata, self.kv_cache), b
            try:
                return self._call(key, (input_ids, positions))
            finally:
                self.handle.batch = None
        tracing = self.state is CompileState.WAITING
        # Tracing: each kind's width is a dynamic dimension, traced at a size of its own (distinct
        # from the others' and from any batch size, or torch.compile would tie them into one symbol).
        widths = [MIN_WIDTH + 9 + 2 * i for i in range(len(self.layout.kinds))] if tracing else None
        tables = DecodeTables.build(self.layout, metadata, size, widths)
        if tracing:
            for t, at in zip(tables.keys, tables.state):
                torch._dynamo.mark_dynamic(t, 2, min=MIN_WIDTH, max=1 << 18)
                torch._dynamo.mark_dynamic(at, 1, min=MIN_WIDTH, max=1 << 18)
                if compiling:
                    torch._dynamo.mark_dynamic(t, 1, min=2, max=MAX_ROWS)
                    torch._dynamo.mark_dynamic(at, 0, min=2, max=MAX_ROWS)
        logits, hidden, new_kv = self._call(key, (input_ids, positions, self.layout.kv, *tables.keys, *tables.state))
        tables.commit(self.layout, new_kv)
        return logits, hidden

    def _call(self, key: int | None, call: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(logits, hidden[, new K/V where attention is traced]) of the graph `key` (a static size, None: the dynamic one) for the
        call's tensors (ids, positions[, KV arena, key tables...]): directly where its capture was
        verified and its guards hold, else through Dynamo (whose first call traces and captures)."""
        direct = self._direct.get(key)
        if isinstance(direct, DirectGraph) and direct.verified:
            out = direct(call)
            if out is not None:
                return tuple(out)
        graph = self._dynamic if key is None else self._static
        waiting = self.state is CompileState.WAITING
        if waiting:
            self._tracing = (key, call)
            self._direct.pop(key, None)
        try:
            kinds = len(self.layout.kinds) if self.layout is not None else 0
            result = graph(*call) if len(call) == 2 else graph(*call[:3], list(call[3:3 + kinds]),
                                                               list(call[3 + kinds:]))
        finally:
            self._tracing = None
        direct = self._direct.get(key)
        if waiting and isinstance(direct, DirectGraph) and not direct.verify(call, result):
            self._direct[key] = "its direct call returned other tensors than Dynamo's"
        if waiting and isinstance(self._direct.get(key), str):
            log.info("decode graph %s runs through Dynamo: %s", key or "dynamic", self._direct[key])
        return result

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """Dynamo's backend: inductor, as `torch.compile`'s default, keeping the graph to call it directly."""
        from torch._inductor.compile_fx import compile_fx

        options = dict(INDUCTOR_OPTIONS)
        if any(not isinstance(v, (torch.Tensor, torch.SymInt)) for v in example_inputs):
            # the C++ wrapper's calls into ops cannot pass Python objects (the opaque attention
            # handle, packed weights): such graphs keep the Python one
            options["cpp_wrapper"] = False
        fn = compile_fx(gm, example_inputs, config_patches=options)
        if self._tracing is not None:
            key, call = self._tracing
            # a graph break splits the step in several graphs: none of them is the step
            if key in self._direct:
                self._direct[key] = "the step traced into several graphs"
            else:
                try:
                    self._direct[key] = DirectGraph.capture(gm, example_inputs, fn, call)
                except Exception as e:   # a layout not foreseen: this graph runs through Dynamo
                    self._direct[key] = f"capture failed: {type(e).__name__}: {e}"
        return fn
