"""The engine: requests in, per-step outputs (text deltas, finished completions) out.

    add_request -> Scheduler -> KV manager -> ModelRunner -> model -> sampler -> OutputProcessor -> outputs

Single-threaded: whoever owns the engine calls `step()` in a loop (LLM, or a server's background loop).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import NoReturn

import torch
# Imported here, while no engine is being built: torch.fx.wrap(), which modules of torch._dynamo call as they are
# imported, leaves its frame in a reference cycle (a local holds inspect.currentframe()), and a frame holds its
# callers' frames. Imported first inside an engine's construction (the CPU kernels and compiled steps import
# inductor), it would keep that engine, KV cache and weights included, alive after `del` until the garbage collector
# runs.
import torch._dynamo  # noqa: F401

from ..config.engine import EngineConfig
from ..errors import UserInputError
from ..models.loader import LoadedModel
from .compile.compiled_steps import CompiledDecodeSteps
from .adapters import Adapters
from .factory import CompileBuild, EngineInfo, assemble
from .input_processor import InputProcessor
from .internals import EngineInternals
from .media.items import MediaItem
from .model_runner import PendingStep
from .request import FinishReason, Request, RequestOutput
from .sampling_params import SamplingParams
from .snapshot import EngineSnapshot
from .step import StepPlan, StepResult
from .validation import CheckedRequest

log = logging.getLogger(__name__)

# How long a step with nothing to run but requests whose grammars compile waits for one of them.
GRAMMAR_POLL_S = 0.01
# What `close()` lets go of: every part that holds device or host memory, threads or processes.
_RELEASED = ("_executor", "_loaded", "_model", "_tokenizer", "_backend", "_kv", "_grammars", "_runner", "_scheduler",
             "_loras", "_adapters", "_inputs", "_validator", "_outputs", "_compiled_steps")


class EngineClosedError(RuntimeError):
    """The engine was closed (`close()`, or the end of its `with` block): it serves nothing more."""


class LLMEngine:
    """The interface its users (LLM, the server's AsyncEngine, the CLI, the benchmarks) have: `add_request` /
    `validate` and `add_checked`, `abort_request`, `step`, `has_unfinished_requests`, `snapshot()`, `adapters`,
    `info`, `inputs` (preparing prompts and media), `config`, `reset_prefix_cache()`, `check_integrity()` and
    `kv_integrity_steps()`, `warm_up_grammars()`, `poll_builds()`, `shutdown()` and `close()` (also
    `with LLMEngine(...)`). A request is validated once: by `validate` (whose CheckedRequest `add_checked` queues
    as it is) or inside `add_request`. Every part the engine is assembled from is private; engine-internal
    collaborators (connectors/, aot_builder.py) use them, and benchmarks that time one part alone read them
    through `internals()` (internals.py)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        """`loaded`: reuse weights another engine already loaded (same model, dtype and device), e.g.
        to compare cache configurations in one process."""
        parts = assemble(config, loaded)
        self._config = config
        self._device, self._dtype = parts.device, parts.dtype
        self._executor, self._loaded = parts.executor, parts.loaded
        self._model, self._tokenizer = parts.loaded.model, parts.loaded.tokenizer
        self._max_model_len = parts.max_model_len
        self._backend, self._cache_options, self._kv = parts.backend, parts.cache_options, parts.kv
        self._kv_heads = parts.kv_heads
        self._grammars, self._suppressed_token_ids = parts.grammars, parts.suppressed_token_ids
        self._runner, self._scheduler = parts.runner, parts.scheduler
        self._loras = parts.loras
        self._inputs, self._validator, self._outputs = parts.inputs, parts.validator, parts.outputs
        self._async_scheduling = parts.async_scheduling
        self._info = parts.info
        self._inflight: tuple[StepPlan, PendingStep] | None = None   # launched, result not taken yet
        self._requests: dict[str, Request] = {}        # engine id -> unfinished request
        self._groups: dict[str, list[Request]] = {}    # user id -> its n completions (until all finish)
        self._ids = itertools.count()
        self._closed = False
        self._adapters = Adapters(self._loras, self._scheduler.lora_slots, self._requests)
        for name, path in (config.lora_modules or {}).items():
            self._adapters.add(name, path)
        # Called with each computed step before it is committed (its requests' pages still held):
        # a disaggregated prefill engine copies a finished prompt's KV out here (engine/connectors/kv_handoff.py).
        self._step_observers: list[Callable[[StepPlan, StepResult], None]] = []
        self._compiled_steps = CompiledDecodeSteps(config, parts)
        self._compiled_steps.set_up(config.cpu_compile_mode(self._device, bool(self._loaded.weight_formats)))
        if self._device.type == "cuda":
            self._info = dataclasses.replace(self._info, warmup_seconds=self._warm_up())
        log.info("engine ready: %s", self.info)

    # -- what the engine is ---------------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def info(self) -> EngineInfo:
        if self._closed:
            return self._info   # as it was when closed
        build = self._compiled_steps.build
        return dataclasses.replace(self._info, cpu_compile=self._compiled_steps.state, cpu_compile_build=None
                                   if build is None else CompileBuild(build.process.pid if build.process else None,
                                                                      str(build.log_path)))

    @property
    def adapters(self) -> Adapters:
        """The LoRA adapters served: add and remove (between steps), names, refs, `in`."""
        return self._adapters

    @property
    def inputs(self) -> InputProcessor:
        """Preparing requests: prompt text to ids, chat media loaded and placed (see input_processor.py)."""
        return self._inputs

    def snapshot(self) -> EngineSnapshot:
        """The engine's counters and gauges now (call it where `step` is called: between steps)."""
        st = self._kv.stats()
        sched = self._scheduler
        spec = sched.spec_stats
        return EngineSnapshot(
            waiting=len(sched.waiting), running=len(sched.running), pages_total=st.num_pages,
            pages_used=st.pages_used, pages_free=st.pages_free, pages_cached=st.pages_cached,
            pages_scratch=st.scratch_pages, preemptions=sched.num_preemptions,
            prefix_query_tokens=st.prefix_query_tokens, prefix_hit_tokens=st.prefix_hit_tokens,
            spec=dataclasses.replace(spec, accepted_at=list(spec.accepted_at), drafted_at=list(spec.drafted_at)),
            tier=self._kv.tier.stats() if self._kv.tier is not None else None,
            lora_running=_per_adapter(sched.running), lora_waiting=_per_adapter(sched.waiting),
            lora_adapters=len(self._adapters), max_loras=self._config.max_loras)

    def warm_up_grammars(self) -> futures.Future:
        """Build structured output's per-tokenizer state now, on a worker thread (a server does, before it
        says ready), rather than at the first structured request."""
        return self._grammars.warm_up()

    def poll_builds(self) -> bool:
        """Switch to compiled decode steps if their background build just finished (`step` does it too; an idle
        loop calls this). True while a build still runs."""
        return self._compiled_steps.poll()

    def check_integrity(self) -> None:
        """The KV manager's whole integrity check now (AssertionError if its bookkeeping is inconsistent)."""
        self._kv.check_integrity()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the pages go back to the free list, the host tier is emptied, and the prefix
        hit counters start again from zero, as after a fresh start); running requests keep their pages."""
        self._kv.reset_prefix_cache()

    def kv_integrity_steps(self) -> Iterator[None]:
        """The KV manager's integrity check in slices (a generator: AssertionError if the bookkeeping is
        inconsistent), for an idle engine thread to run between looks at its queue."""
        return self._kv.integrity_steps()

    def _warm_up(self) -> float:
        """Run a full-budget prefill step (two sequences, lengths not multiples of 16) and a few decode
        steps on dummy tokens, so the first request pays for no kernel compilation or allocator
        growth. It leaves nothing behind: pages freed, prefix cache and its statistics reset."""
        start = time.perf_counter()
        budget = min(self._config.max_num_batched_tokens, self._max_model_len - 4)
        lengths = [n for n in (budget - 17, 17) if n > 1] or [2]
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        vocab = self._model.vocab_size
        for i, n in enumerate(lengths):
            prompt = [(7 + 31 * (j + 101 * i)) % vocab for j in range(n)]
            try:
                self._validator.check(prompt, params)
            except UserInputError:
                continue   # a KV cache too small for the full budget: warm up what fits
            self.add_request("", params, prompt_ids=prompt, request_id=f"__warmup__{i}")
        while self.has_unfinished_requests():
            self.step()
        self._kv.reset_prefix_cache()
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return round(time.perf_counter() - start, 3)

    # -- requests ------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams, media: list[MediaItem] | None = None,
                 lora: str | None = None, *, text: str = "", strict_length: bool = False) -> CheckedRequest:
        """Check that the request can ever run (validation.py: the checks `add_request` runs), waiting for its
        grammar to compile: a UserInputError (ContextLengthError, GrammarError) says what is wrong. The
        result goes to `add_checked`, which queues it without checking again. `text`: the prompt as text
        (outputs carry it). `strict_length`: prompt and max_tokens must fit max_model_len together.
        Reads only what is fixed when the engine is built (and the thread-safe grammar cache): any thread."""
        return self._check(prompt_ids, params, media, lora, text, wait_for_grammar=True, strict_length=strict_length)

    def _check(self, prompt_ids: list[int], params: SamplingParams, media: list[MediaItem] | None, lora: str | None,
               text: str, wait_for_grammar: bool, strict_length: bool = False) -> CheckedRequest:
        if lora is not None:
            self._loras.get(lora)   # an unknown name
        ids, media = list(prompt_ids), list(media or [])
        chunk = self._validator.check(ids, params, media, wait_for_grammar, strict_length)
        return CheckedRequest(ids, params, media, lora, text, chunk)

    def add_request(self, prompt: str, params: SamplingParams, prompt_ids: list[int] | None = None,
                    request_id: str | None = None, media: list[MediaItem] | None = None,
                    lora: str | None = None) -> str:
        """Check and queue a request (`params.n` completions). Returns its id; outputs carry it. `media`
        (images, audio clips): from `inputs.prepare`, which also gives the `prompt_ids` they sit in.
        `lora`: the name of a loaded LoRA adapter to run it with (None: the base model). The grammar is
        not waited for here (a later failure fails the request): `validate` first to have it checked."""
        ids = self._inputs.tokenize(prompt) if prompt_ids is None else prompt_ids
        if media and prompt_ids is None:
            raise UserInputError("images and audio need the prompt ids inputs.prepare() returns")
        return self.add_checked(self._check(ids, params, media, lora, prompt, wait_for_grammar=False), request_id)

    def add_checked(self, checked: CheckedRequest, request_id: str | None = None) -> str:
        """Queue a request `validate` (or `add_request`) checked, as it is. Returns its id."""
        params, ids = checked.params, checked.prompt_ids
        adapter = None if checked.lora is None else self._loras.get(checked.lora)   # (removed since?)
        group_id = request_id if request_id is not None else str(next(self._ids))
        if not isinstance(group_id, str) or not group_id:
            raise UserInputError("request_id must be a non-empty string")
        if group_id in self._groups:
            raise UserInputError(f"request id {group_id!r} is already in use")
        max_total = min(len(ids) + params.max_tokens, self._max_model_len)
        # Compiled on a worker thread (cached): the request is admitted once it is ready.
        grammar = self._grammars.submit(params.structured_output) if params.structured_output is not None else None
        group: list[Request] = []
        for i in range(params.n):
            seed = params.seed
            if seed is None:
                seed = secrets.randbits(63)
            elif i > 0:  # siblings must differ, yet stay reproducible
                seed = int.from_bytes(hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest(), "little") >> 1
            req = Request(
                request_id=group_id if params.n == 1 else f"{group_id}#{i}", group_id=group_id, index=i,
                prompt=checked.text, prompt_token_ids=ids, params=params, eos_token_ids=self._tokenizer.stop_token_ids,
                max_total_tokens=max_total, seed=seed, max_chunk_tokens=checked.max_chunk_tokens,
                media=list(checked.media),
                # Siblings wait for the first one's prompt, then share its pages via the prefix cache.
                wait_for=group[0] if i and self._cache_options.enable_prefix_caching else None,
                grammar=grammar, lora=adapter)
            group.append(req)
        self._groups[group_id] = group
        for req in group:
            self._requests[req.request_id] = req
            self._outputs.add(req)
            self._scheduler.add(req)
        return group_id

    def _request(self, request_id: str) -> Request:
        """An unfinished engine request by its engine id (a group of n > 1 has ids "<id>#<index>")."""
        return self._requests[request_id]

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Let go of everything the engine holds, now, even if something still refers to the engine: stop the
        executor's workers (tensor parallelism) and the grammar compile threads, drop unfinished requests, the KV
        cache, compiled steps, CUDA graphs and the model (its weights are freed unless another engine shares
        them). A closed engine raises EngineClosedError for anything it would need them for. Idempotent; `with
        LLMEngine(...) as engine:` closes it at the end of the block. A background build of compiled CPU steps
        runs on: its packages are for whichever engine starts next (compile/build_job.py)."""
        if self._closed:
            return
        self._info = self.info
        self._closed = True
        try:
            self._executor.shutdown()
            self._grammars.close()
        finally:
            for name in _RELEASED:
                self.__dict__.pop(name, None)
            self._inflight, self._requests, self._groups, self._step_observers = None, {}, {}, []
            if self._device.type == "cuda":
                # A later engine sizes its KV cache from the driver's free memory (EngineConfig.kv_budget_bytes),
                # which counts the blocks PyTorch's allocator keeps cached as used: hand them back. Cheap (it
                # frees only blocks no tensor uses) and safe for other engines here (they allocate again if
                # they need more); the device finishes what was launched first.
                torch.cuda.synchronize(self._device)
                torch.cuda.empty_cache()

    def shutdown(self) -> None:
        """Stop what the executor started (tensor-parallel workers); also runs at interpreter exit. `close()` does
        this and lets go of the rest."""
        if not self._closed:
            self._executor.shutdown()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> NoReturn:
        """Only for attributes not found: those `close()` released say so."""
        if name in _RELEASED and self.__dict__.get("_closed"):
            raise EngineClosedError(f"the engine is closed (close(), or the end of its `with` block): its {name[1:]} is "
                                    "gone; create another engine")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort every unfinished completion of a request, wherever it is (queued, prefilling,
        decoding, preempted), freeing its pages at once. Returns their final outputs."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        outputs = []
        for req in group:
            if req.is_finished:
                continue
            req.finish(FinishReason.ABORT)
            self._scheduler.finish(req)
            del self._requests[req.request_id]
            outputs.append(self._outputs.output(req))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return not self._closed and (self._scheduler.has_unfinished() or self._inflight is not None)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass. Returns an output for every completion that produced text or
        finished in it (its `delta_*` fields hold what is new).

        Asynchronous scheduling: step N+1 is scheduled and launched before step N's sampled ids are
        read back, so the device never waits for the host; the outputs returned are step N's (one
        step behind), and a final call with nothing left to schedule collects the last one."""
        self._compiled_steps.poll()
        # A grammar that finishes compiling while the step is scheduled lets its request in only at the next one.
        grammars_ready = all(r.grammar.done() for r in self._scheduler.waiting if r.grammar is not None)
        plan = self._scheduler.schedule()
        launched = None
        if plan.seqs:
            launched = self._launch(plan)
        else:
            self._runner.apply(plan)   # requests may still have left
            compiling = [r.grammar for r in self._scheduler.waiting if r.grammar is not None and not r.grammar.done()]
            if compiling and self._inflight is None:   # nothing else to do: wait a little, not spin
                futures.wait(compiling, timeout=GRAMMAR_POLL_S, return_when=futures.FIRST_COMPLETED)
            elif self._scheduler.waiting and not self._scheduler.running and self._inflight is None and grammars_ready:
                raise RuntimeError("scheduler made no progress with an empty running set")  # a bug, never input
        if not self._async_scheduling and launched is not None:
            return self._update(plan, launched.resolve())
        outputs: list[RequestOutput] = []
        if self._inflight is not None:
            outputs = self._update(*self._take_inflight())
        if launched is not None:
            self._inflight = (plan, launched)
        return outputs

    def _take_inflight(self) -> tuple[StepPlan, StepResult]:
        plan, pending = self._inflight
        self._inflight = None
        try:
            return plan, pending.resolve()
        except Exception as exc:   # the device failed running it: rerun its sequences one by one
            log.warning("a launched step of %d sequences failed (%r); retrying them one by one", len(plan.seqs), exc)
            return plan, self._one_by_one(plan)

    def _commit_step(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Commit a step computed elsewhere (a disaggregated decode engine takes the first token its
        prefill engine sampled this way). Returns the outputs, as `step` does."""
        return self._update(plan, result)

    def _update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        for observe in self._step_observers:
            observe(plan, result)
        emitted = result.by_request()
        outputs = []
        for req in self._scheduler.update_from_output(plan, result):
            ended = self._outputs.process(req, [lp for _, lp in emitted.get(req.request_id, ())])
            if ended is not None:   # a stop string, or the text failed
                req.error = ended.error
                req.finish(ended.reason, ended.stop_reason)
            if req.is_finished:
                self._retire(req)
            outputs.append(self._outputs.output(req))
        return outputs

    def _launch(self, plan: StepPlan) -> "PendingStep | _Done":
        """Queue the plan. If that raises, rerun each sequence alone (re-writing a step's KV positions
        is harmless), so that only the requests that fail by themselves fail."""
        try:
            return self._runner.launch(plan)
        except Exception as exc:
            if len(plan.seqs) == 1:
                return _Done(self._failed(plan.seqs[0].req_id, exc))
            log.warning("a batch of %d sequences failed (%r); retrying them one by one", len(plan.seqs), exc)
        return _Done(self._one_by_one(plan))

    def _one_by_one(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        for i, s in enumerate(plan.seqs):
            try:
                result.merge(self._runner.execute(plan, only=[i]))
            except Exception as exc:
                result.merge(self._failed(s.req_id, exc))
        return result

    @staticmethod
    def _failed(req_id: str, exc: Exception) -> StepResult:
        log.error("request %s failed", req_id, exc_info=exc)
        return StepResult(failed={req_id: f"{type(exc).__name__}: {exc}"})

    def _retire(self, req: Request) -> None:
        """A finished request leaves the engine's tables (the scheduler already freed its pages)."""
        self._scheduler.finish(req)
        del self._requests[req.request_id]
        group = self._groups.get(req.group_id)
        if group is not None and all(r.is_finished for r in group):
            del self._groups[req.group_id]

    def internals(self) -> EngineInternals:
        """The parts this engine is assembled from, for benchmarks and tests that time or check one of them
        (internals.py: what may read it, and what not)."""
        return EngineInternals(self._kv, self._scheduler, self._runner, self._model, self._tokenizer, self._loaded,
                               self._compiled_steps, self._outputs, self._device, self._dtype, self._max_model_len)


def _per_adapter(requests) -> tuple[tuple[str, int], ...]:
    """(adapter name, completions) of the requests that run under an adapter, by name."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora is not None:
            counts[r.lora.name] = counts.get(r.lora.name, 0) + 1
    return tuple(sorted(counts.items()))


@dataclass
class _Done:
    """A step that already has its result (it failed and was rerun one sequence at a time)."""

    result: StepResult

    def resolve(self) -> StepResult:
        return self.result
