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
from collections.abc import Callable
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
from .factory import EngineInfo, assemble
from .media.items import MediaItem
from .model_runner import PendingStep
from .request import FinishReason, Request, RequestOutput
from .sampling_params import SamplingParams
from .step import StepPlan, StepResult

log = logging.getLogger(__name__)

# How long a step with nothing to run but requests whose grammars compile waits for one of them.
GRAMMAR_POLL_S = 0.01
# What `close()` lets go of: every part that holds device or host memory, threads or processes.
_RELEASED = ("executor", "loaded", "model", "tokenizer", "backend", "kv", "grammars", "runner", "scheduler", "loras",
             "inputs", "outputs", "compiled_steps")


class EngineClosedError(RuntimeError):
    """The engine was closed (`close()`, or the end of its `with` block): it serves nothing more."""


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        """`loaded`: reuse weights another engine already loaded (same model, dtype and device), e.g.
        to compare cache configurations in one process."""
        parts = assemble(config, loaded)
        self.config = config
        self.device, self.dtype = parts.device, parts.dtype
        self.executor, self.loaded = parts.executor, parts.loaded
        self.model, self.tokenizer = parts.loaded.model, parts.loaded.tokenizer
        self.max_model_len = parts.max_model_len
        self.backend, self.cache_options, self.kv = parts.backend, parts.cache_options, parts.kv
        self.kv_heads = parts.kv_heads
        self.grammars, self.suppressed_token_ids = parts.grammars, parts.suppressed_token_ids
        self.runner, self.scheduler = parts.runner, parts.scheduler
        self.loras = parts.loras
        for name, path in (config.lora_modules or {}).items():
            self.loras.add(name, path)
        self.inputs, self.outputs = parts.inputs, parts.outputs
        self.async_scheduling = parts.async_scheduling
        self._info = parts.info
        self._inflight: tuple[StepPlan, PendingStep] | None = None   # launched, result not taken yet
        self._requests: dict[str, Request] = {}        # engine id -> unfinished request
        self._groups: dict[str, list[Request]] = {}    # user id -> its n completions (until all finish)
        self._ids = itertools.count()
        self._closed = False
        # Called with each computed step before it is committed (its requests' pages still held):
        # a disaggregated prefill engine copies a finished prompt's KV out here (engine/connectors/kv_handoff.py).
        self.step_observers: list[Callable[[StepPlan, StepResult], None]] = []
        self.compiled_steps = CompiledDecodeSteps(config, parts)
        self.compiled_steps.set_up(config.cpu_compile_mode(self.device, bool(self.loaded.weight_formats)))
        if self.device.type == "cuda":
            self._info = dataclasses.replace(self._info, warmup_seconds=self._warm_up())
        log.info("engine ready: %s", self.info)

    @property
    def info(self) -> EngineInfo:
        if self._closed:
            return self._info   # as it was when closed
        return dataclasses.replace(self._info, cpu_compile=self.compiled_steps.state)

    def _warm_up(self) -> float:
        """Run a full-budget prefill step (two sequences, lengths not multiples of 16) and a few decode
        steps on dummy tokens, so the first request pays for no kernel compilation or allocator
        growth. It leaves nothing behind: pages freed, prefix cache and its statistics reset."""
        start = time.perf_counter()
        budget = min(self.config.max_num_batched_tokens, self.max_model_len - 4)
        lengths = [n for n in (budget - 17, 17) if n > 1] or [2]
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        vocab = self.model.vocab_size
        for i, n in enumerate(lengths):
            prompt = [(7 + 31 * (j + 101 * i)) % vocab for j in range(n)]
            try:
                self.inputs.check_request(prompt, params)
            except UserInputError:
                continue   # a KV cache too small for the full budget: warm up what fits
            self.add_request("", params, prompt_ids=prompt, request_id=f"__warmup__{i}")
        while self.has_unfinished_requests():
            self.step()
        self.kv.reset_prefix_cache()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return round(time.perf_counter() - start, 3)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str, params: SamplingParams, prompt_ids: list[int] | None = None,
                    request_id: str | None = None, media: list[MediaItem] | None = None,
                    lora: str | None = None) -> str:
        """Queue a request (`params.n` completions). Returns its id; outputs carry it. `media`
        (images, audio clips): from `inputs.prepare`, which also gives the `prompt_ids` they sit in.
        `lora`: the name of a loaded LoRA adapter to run it with (None: the base model)."""
        adapter = None if lora is None else self.loras.get(lora)
        ids = self.inputs.tokenize(prompt) if prompt_ids is None else list(prompt_ids)
        media = list(media or [])
        if media and prompt_ids is None:
            raise UserInputError("images and audio need the prompt ids inputs.prepare() returns")
        max_chunk = self.inputs.check_request(ids, params, media, wait_for_grammar=False)
        group_id = request_id if request_id is not None else str(next(self._ids))
        if not isinstance(group_id, str) or not group_id:
            raise UserInputError("request_id must be a non-empty string")
        if group_id in self._groups:
            raise UserInputError(f"request id {group_id!r} is already in use")
        max_total = min(len(ids) + params.max_tokens, self.max_model_len)
        # Compiled on a worker thread (cached): the request is admitted once it is ready.
        grammar = self.grammars.submit(params.structured_output) if params.structured_output is not None else None
        group: list[Request] = []
        for i in range(params.n):
            seed = params.seed
            if seed is None:
                seed = secrets.randbits(63)
            elif i > 0:  # siblings must differ, yet stay reproducible
                seed = int.from_bytes(hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest(), "little") >> 1
            req = Request(
                request_id=group_id if params.n == 1 else f"{group_id}#{i}", group_id=group_id, index=i,
                prompt=prompt, prompt_token_ids=ids, params=params, eos_token_ids=self.tokenizer.stop_token_ids,
                max_total_tokens=max_total, seed=seed, max_chunk_tokens=max_chunk, media=media,
                # Siblings wait for the first one's prompt, then share its pages via the prefix cache.
                wait_for=group[0] if i and self.cache_options.enable_prefix_caching else None,
                grammar=grammar, lora=adapter)
            group.append(req)
        self._groups[group_id] = group
        for req in group:
            self._requests[req.request_id] = req
            self.outputs.add(req)
            self.scheduler.add(req)
        return group_id

    # -- LoRA adapters -----------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (read and checked now: a UserInputError says what is wrong).
        Under tensor parallelism each rank reads its slice when the scheduler first puts it into a slot."""
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter `name`; refused while unfinished requests use it."""
        ref = self.loras.get(name)
        users = sum(1 for r in self._requests.values() if r.lora is not None and r.lora.key == ref.key)
        if users:
            raise UserInputError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
        self.loras.remove(name)
        self.scheduler.lora_slots.forget(ref)

    def request(self, request_id: str) -> Request:
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
            self.executor.shutdown()
            self.grammars.close()
        finally:
            for name in _RELEASED:
                self.__dict__.pop(name, None)
            self._inflight, self._requests, self._groups, self.step_observers = None, {}, {}, []
            if self.device.type == "cuda":
                # A later engine sizes its KV cache from the driver's free memory (EngineConfig.kv_budget_bytes),
                # which counts the blocks PyTorch's allocator keeps cached as used: hand them back. Cheap (it
                # frees only blocks no tensor uses) and safe for other engines here (they allocate again if
                # they need more); the device finishes what was launched first.
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()

    def shutdown(self) -> None:
        """Stop what the executor started (tensor-parallel workers); also runs at interpreter exit. `close()` does
        this and lets go of the rest."""
        if not self._closed:
            self.executor.shutdown()

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
            raise EngineClosedError(f"the engine is closed (close(), or the end of its `with` block): its {name} is "
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
            self.scheduler.finish(req)
            del self._requests[req.request_id]
            outputs.append(self.outputs.output(req))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return not self._closed and (self.scheduler.has_unfinished() or self._inflight is not None)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass. Returns an output for every completion that produced text or
        finished in it (its `delta_*` fields hold what is new).

        Asynchronous scheduling: step N+1 is scheduled and launched before step N's sampled ids are
        read back, so the device never waits for the host; the outputs returned are step N's (one
        step behind), and a final call with nothing left to schedule collects the last one."""
        self.compiled_steps.poll()
        # A grammar that finishes compiling while the step is scheduled lets its request in only at the next one.
        grammars_ready = all(r.grammar.done() for r in self.scheduler.waiting if r.grammar is not None)
        plan = self.scheduler.schedule()
        launched = None
        if plan.seqs:
            launched = self._launch(plan)
        else:
            self.runner.apply(plan)   # requests may still have left
            compiling = [r.grammar for r in self.scheduler.waiting if r.grammar is not None and not r.grammar.done()]
            if compiling and self._inflight is None:   # nothing else to do: wait a little, not spin
                futures.wait(compiling, timeout=GRAMMAR_POLL_S, return_when=futures.FIRST_COMPLETED)
            elif self.scheduler.waiting and not self.scheduler.running and self._inflight is None and grammars_ready:
                raise RuntimeError("scheduler made no progress with an empty running set")  # a bug, never input
        if not self.async_scheduling and launched is not None:
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

    def commit_step(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Commit a step computed elsewhere (a disaggregated decode engine takes the first token its
        prefill engine sampled this way). Returns the outputs, as `step` does."""
        return self._update(plan, result)

    def _update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        for observe in self.step_observers:
            observe(plan, result)
        emitted = result.by_request()
        outputs = []
        for req in self.scheduler.update_from_output(plan, result):
            ended = self.outputs.process(req, [lp for _, lp in emitted.get(req.request_id, ())])
            if ended is not None:   # a stop string, or the text failed
                req.error = ended.error
                req.finish(ended.reason, ended.stop_reason)
            if req.is_finished:
                self._retire(req)
            outputs.append(self.outputs.output(req))
        return outputs

    def _launch(self, plan: StepPlan) -> "PendingStep | _Done":
        """Queue the plan. If that raises, rerun each sequence alone (re-writing a step's KV positions
        is harmless), so that only the requests that fail by themselves fail."""
        try:
            return self.runner.launch(plan)
        except Exception as exc:
            if len(plan.seqs) == 1:
                return _Done(self._failed(plan.seqs[0].req_id, exc))
            log.warning("a batch of %d sequences failed (%r); retrying them one by one", len(plan.seqs), exc)
        return _Done(self._one_by_one(plan))

    def _one_by_one(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        for i, s in enumerate(plan.seqs):
            try:
                result.merge(self.runner.execute(plan, only=[i]))
            except Exception as exc:
                result.merge(self._failed(s.req_id, exc))
        return result

    @staticmethod
    def _failed(req_id: str, exc: Exception) -> StepResult:
        log.error("request %s failed", req_id, exc_info=exc)
        return StepResult(failed={req_id: f"{type(exc).__name__}: {exc}"})

    def _retire(self, req: Request) -> None:
        """A finished request leaves the engine's tables (the scheduler already freed its pages)."""
        self.scheduler.finish(req)
        del self._requests[req.request_id]
        group = self._groups.get(req.group_id)
        if group is not None and all(r.is_finished for r in group):
            del self._groups[req.group_id]


@dataclass
class _Done:
    """A step that already has its result (it failed and was rerun one sequence at a time)."""

    result: StepResult

    def resolve(self) -> StepResult:
        return self.result
