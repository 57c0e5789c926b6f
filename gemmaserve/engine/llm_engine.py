"""The engine: requests in, per-step outputs (text deltas, finished completions) out.

    add_request -> Scheduler -> KV manager -> ModelRunner -> model -> sampler -> detokenizer -> outputs

Single-threaded: whoever owns the engine calls `step()` in a loop (LLM, or a server's background loop).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import torch

from ..attention import select_backend
from ..attention.kv_quant import FP8_DTYPE
from ..config.engine import EngineConfig
from ..units import format_bytes
from ..config.resolve import (BATCH_INVARIANT_CHANGES, BatchInvariance, resolve_batch_invariance,
                              resolve_cache_options)
from ..errors import UserInputError
from ..kv import create_kv_manager
from ..models.layers import set_batch_invariant
from ..models.loader import LoadedModel
from ..models.multimodal import ProcessedImage
from ..transfer.runtime import probe as probe_transfer
from .detokenizer import IncrementalDetokenizer
from .aot_build import BuildJob
from .executor import create_executor
from .images import ImageItem, ImageLimits, expand_prompt, load_image, place_images
from .kv_calibration import calibrate_kv_scales, calibration_tokens
from .model_runner import PendingStep
from .request import FinishReason, Request, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .structured_output import Grammars
from .step import StepPlan, StepResult

log = logging.getLogger(__name__)

# The options a compiled decode step depends on, which a background build is given (aot_build.py).
_BUILD_FIELDS = ("model", "dtype", "kv_cache_dtype", "kv_cache_manager", "page_size", "swa_scratch_reuse",
                 "attention_backend", "max_model_len")
# How long a step with nothing to run but requests whose grammars compile waits for one of them.
GRAMMAR_POLL_S = 0.01


@dataclass(frozen=True)
class EngineInfo:
    model: str
    device: str
    dtype: str
    weights: str          # "float32", or the quantised formats: "int8 x 126, int4 x 18, embedding_int8 x 1"
    kv_cache_dtype: str
    max_model_len: int
    kv_manager: str
    swa_scratch_reuse: bool
    prefix_caching: bool
    attention_backend: str
    cuda_graphs: bool
    async_scheduling: bool
    kv_pages: int
    kv_page_size: int
    kv_bytes: int
    load_seconds: float
    warmup_seconds: float = 0.0
    tensor_parallel_size: int = 1
    cpu_compile: str = "off"   # compiled CPU decode steps: off, unavailable, building, ready, failed (eager)
    batch_invariant: bool = False   # --batch-invariant (config/resolve.py: what it replaces)


def _weights_label(loaded: LoadedModel, dtype: torch.dtype) -> str:
    formats = loaded.weight_formats
    if not formats:
        return str(dtype).removeprefix("torch.")
    return ", ".join(f"{fmt} x {n}" for fmt, n in formats.items() if n)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        """`loaded`: reuse weights another engine already loaded (same model, dtype and device), e.g.
        to compare cache configurations in one process."""
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        self.executor = create_executor(config)   # tensor parallelism: workers start loading their shards
        if loaded is None:
            loaded = self.executor.load_model(self.dtype, self.device)
        self.loaded = loaded
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        limit = self.model.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise UserInputError(f"max_model_len {config.max_model_len} exceeds the model's context length {limit}")
        self.max_model_len = config.max_model_len or limit

        kv_dtype = config.torch_kv_dtype(self.dtype)
        specs = self.executor.local_kv_specs(self.model.kv_layer_specs(kv_dtype))   # one device's KV heads
        if kv_dtype == FP8_DTYPE:
            specs = calibrate_kv_scales(self.model, specs, calibration_tokens(self.tokenizer, self.model.vocab_size),
                                        self.device)
        self.backend = select_backend(config.attention_backend, self.device, specs)
        invariance = resolve_batch_invariance(config, self.device.type, self.backend.capabilities,
                                              bool(loaded.weight_formats))
        self.backend.batch_invariant = invariance is BatchInvariance.KERNELS
        set_batch_invariant(self.model, self.backend.batch_invariant)   # reused weights follow this engine
        if self.backend.batch_invariant:
            log.info("batch invariant: %s", "; ".join(BATCH_INVARIANT_CHANGES))
        elif config.batch_invariant:
            log.info("batch invariant: every CPU step is (row-independent kernels, blockwise attention)")
        self.cache_options = resolve_cache_options(config, self.model.engine_preferences(), self.backend.capabilities,
                                                   specs, probe=lambda name: probe_transfer(name, self.device))
        self.kv = create_kv_manager(self.cache_options.kv_cache_manager, specs, config.page_size,
                                    config.kv_budget_bytes(self.device),
                                    enable_prefix_caching=self.cache_options.enable_prefix_caching,
                                    enable_scratch=self.cache_options.swa_scratch_reuse,
                                    sliding_share=config.kv_pool_split)
        use_graphs = (self.device.type == "cuda" and not config.enforce_eager
                      and self.backend.capabilities.cuda_graphs)
        self.image_layout = getattr(self.model, "image_layout", None)
        if self.image_layout is not None:
            self.image_layout = self.image_layout.with_texts(self.tokenizer.special_text)
        if self.image_layout is not None and config.max_num_batched_tokens < self.image_layout.max_tokens_per_image:
            raise UserInputError(f"max_num_batched_tokens {config.max_num_batched_tokens} is below the "
                                 f"{self.image_layout.max_tokens_per_image} tokens an image can take (an image is "
                                 "never split across prefill chunks)")
        # A text-only model has seen media tokens only as tokens, never with their embeddings: left
        # free it may emit them (the 270M base model answers a haiku prompt with <start_of_image> x 24).
        suppress = config.suppress_media_tokens
        if suppress is None:
            suppress = not self.model.config.multimodal
        self.suppressed_token_ids = sorted(t for t in self.tokenizer.media_token_ids
                                           if t < self.model.vocab_size) if suppress else []
        self.grammars = Grammars(self.tokenizer, self.model.vocab_size)   # built on first use
        self.runner = self.executor.create_runner(self.model, self.backend, self.kv.layout, self.kv.groups,
                                  self.kv.layer_slot, specs,
                                  self.device, cuda_graphs=use_graphs, max_model_len=self.max_model_len,
                                  max_batch=config.max_num_seqs, encoder_cache_bytes=config.encoder_cache_memory,
                                  suppress_token_ids=self.suppressed_token_ids, grammars=self.grammars)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.async_scheduling = (config.async_scheduling == "on"
                                 or (config.async_scheduling == "auto" and self.device.type == "cuda"))
        self._inflight: tuple[StepPlan, PendingStep] | None = None   # launched, result not taken yet
        self._requests: dict[str, Request] = {}        # engine id -> unfinished request
        self._groups: dict[str, list[Request]] = {}    # user id -> its n completions (until all finish)
        self._ids = itertools.count()
        # Called with each computed step before it is committed (its requests' pages still held):
        # a disaggregated prefill engine copies a finished prompt's KV out here (engine/kv_handoff.py).
        self.step_observers: list[Callable[[StepPlan, StepResult], None]] = []
        self.info = EngineInfo(
            model=config.model, device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
            weights=_weights_label(loaded, self.dtype),
            kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
            max_model_len=self.max_model_len, kv_manager=self.kv.name,
            swa_scratch_reuse=self.cache_options.swa_scratch_reuse,
            prefix_caching=self.cache_options.enable_prefix_caching,
            attention_backend=self.backend.capabilities.name, cuda_graphs=self.runner.graphs is not None,
            cpu_compile="off",
            async_scheduling=self.async_scheduling,
            kv_pages=self.kv.num_pages,
            kv_page_size=self.kv.page_size, kv_bytes=self.kv.num_pages * self.kv.page_bytes,
            load_seconds=loaded.load_seconds, tensor_parallel_size=config.tensor_parallel_size,
            batch_invariant=invariance is not BatchInvariance.OFF)
        self._specs = specs
        self._build: BuildJob | None = None   # a background build of compiled decode steps, until it ends
        self._set_up_compiled_decode(config.cpu_compile_mode(self.device, bool(loaded.weight_formats)))
        if self.device.type == "cuda":
            self.info = dataclasses.replace(self.info, warmup_seconds=self._warm_up())
        log.info("engine ready: %s", self.info)

    # -- compiled CPU decode steps ---------------------------------------------------------------
    def decode_layout_and_key(self) -> "tuple[object, dict] | str":
        """The KV layout a compiled decode step reads (a DecodeLayout) and the key of its packages
        (aot_decode.py), or why this engine's steps cannot be exported."""
        from ..attention.traced import DecodeLayout
        from ..models.quant import Int8Matmul
        from . import aot_decode

        if self.device.type != "cpu" or self.config.tensor_parallel_size > 1:
            return "only single-process CPU engines compile their decode steps"
        if any(isinstance(v, Int8Matmul) and v._packed is not None for m in self.model.modules() for v in vars(m).values()):
            return "fbgemm's packed weights on a CPU without VNNI are Python objects, which an export cannot hold"
        layout = DecodeLayout.of(self._specs, self.runner.kv_cache, self.kv.layer_slot, self.kv.layout.tokens_per_page,
                                 self.kv.layout.num_pages)
        if isinstance(layout, str):
            return layout
        return layout, aot_decode.artifact_key(self.loaded.source.path, self.info.weights, layout)

    def decode_store(self) -> "Path | None":
        """Where this engine's compiled decode packages live (or would), None if it has none."""
        from . import aot_decode

        found = self.decode_layout_and_key()
        return None if isinstance(found, str) else aot_decode.store_dir(found[1])

    def _set_up_compiled_decode(self, mode: str) -> None:
        """`mode` (EngineConfig.cpu_compile_mode): "off"; "background": load the packages if the cache
        has them, else start their build and step eagerly until it is done; "now": load or build them
        before returning (compiled_decode.py's torch.compile where they cannot be exported)."""
        from . import aot_decode
        from .compiled_decode import unavailable

        if mode == "off":
            return
        why = unavailable()
        found = why or self.decode_layout_and_key()
        if isinstance(found, str):
            if mode == "now" and why is None:
                log.info("compiling CPU decode steps in this process (packages cannot be built here: %s)", found)
                self.runner.compile_decode(required=True)
                self._compiled("ready")
            elif mode == "now":
                raise UserInputError(f"--cpu-compile on: {why}")
            else:
                log.info("CPU decode steps stay eager: %s", found)
                self._compiled("unavailable")
            return
        layout, key = found
        directory = aot_decode.store_dir(key)
        if (directory / "manifest.json").is_file() and self._load_compiled(layout, directory):
            return
        if mode == "now":
            log.info("building compiled CPU decode steps into %s (minutes the first time on a small CPU)", directory)
            aot_decode.build(self.model, layout, key, directory)
            if not self._load_compiled(layout, directory):
                raise RuntimeError(f"the compiled decode steps just built in {directory} do not load")
            return
        if os.environ.get("GEMMASERVE_BACKGROUND_COMPILE", "1") == "0":
            log.info("no compiled CPU decode steps in the cache, and GEMMASERVE_BACKGROUND_COMPILE=0: steps stay eager")
            self._compiled("off")
            return
        fields = {k: getattr(self.config, k) for k in _BUILD_FIELDS}
        self._build = BuildJob.start(fields, directory)
        who = f"pid {self._build.process.pid}" if self._build.process else "another process, already running"
        log.info("compiled CPU decode steps: building in the background (%s; log %s): a few minutes the first "
                 "time on a small CPU, after which this and every later start use them; eager steps meanwhile",
                 who, self._build.log_path)
        self._compiled("building")

    def _load_compiled(self, layout, directory: Path) -> bool:
        from . import aot_decode

        try:
            compiled = aot_decode.AotDecode(self.model, layout, directory, self.config.max_num_seqs)
        except Exception as e:   # stale or damaged packages: build again
            log.warning("compiled decode steps in %s do not load (%s); building them again", directory, e)
            shutil.rmtree(directory, ignore_errors=True)
            return False
        self.runner.use_compiled(compiled)
        log.info("compiled CPU decode steps: loaded from %s in %.2f s", directory, compiled.load_seconds)
        self._compiled("ready")
        return True

    def _compiled(self, state: str) -> None:
        self.info = dataclasses.replace(self.info, cpu_compile=state)

    @property
    def compile_build(self) -> "BuildJob | None":
        """The background build of compiled decode steps this engine waits for, if any."""
        return self._build

    def poll_compile(self) -> bool:
        """If a background build just finished, switch to its steps (between two steps). True while a
        build is still running."""
        if self._build is None:
            return False
        outcome = self._build.poll()
        if outcome is None:
            return True
        build, self._build = self._build, None
        if outcome:
            log.warning("compiled CPU decode steps: the build failed, steps stay eager: %s", outcome)
            self._compiled("failed")
            return False
        found = self.decode_layout_and_key()
        if not isinstance(found, str) and self._load_compiled(found[0], build.directory):
            log.info("compiled CPU decode steps ready %.0f s after the engine started building them",
                     time.perf_counter() - build.started)
        else:
            self._compiled("failed")
        return False

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
                self.check_request(prompt, params)
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
    def tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise UserInputError(f"a prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise UserInputError("empty prompt")
        return self.tokenizer.encode(prompt)

    def load_images(self, images: list, limits: ImageLimits | None = None) -> list[ProcessedImage]:
        """Pixels of each image (PIL images, uint8 numpy arrays, file paths, encoded bytes or data
        URLs), within `limits` (count, pixels, bytes)."""
        layout = self.image_layout
        if layout is None:
            raise UserInputError(f"model {self.config.model!r} does not take images")
        limits = limits or ImageLimits()
        if len(images) > limits.max_images:
            raise UserInputError(f"{len(images)} images; at most {limits.max_images} per request")
        return [layout.processor(load_image(im, limits, f"image {i}")) for i, im in enumerate(images)]

    def prepare_images(self, prompt: str, images: list, limits: ImageLimits | None = None
                       ) -> tuple[list[int], list[ImageItem]]:
        """Prompt ids with each image's tokens in place, and the images (pixels, content keys). The
        prompt marks where each image goes with the model's placeholder (none: the images go first)."""
        pixels = self.load_images(images, limits)
        ids = self.tokenize(expand_prompt(prompt, pixels, self.image_layout))
        return ids, place_images(ids, pixels, self.image_layout)

    def add_request(self, prompt: str, params: SamplingParams, prompt_ids: list[int] | None = None,
                    request_id: str | None = None, images: list[ImageItem] | None = None) -> str:
        """Queue a request (`params.n` completions). Returns its id; outputs carry it. `images`:
        from `prepare_images`, which also gives the `prompt_ids` they sit in."""
        ids = self.tokenize(prompt) if prompt_ids is None else list(prompt_ids)
        images = list(images or [])
        if images and prompt_ids is None:
            raise UserInputError("images need the prompt ids prepare_images() returns")
        max_chunk = self.check_request(ids, params, images, wait_for_grammar=False)
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
                max_total_tokens=max_total,
                detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                seed=seed, max_chunk_tokens=max_chunk, images=images,
                # Siblings wait for the first one's prompt, then share its pages via the prefix cache.
                wait_for=group[0] if i and self.cache_options.enable_prefix_caching else None,
                grammar=grammar)
            group.append(req)
        self._groups[group_id] = group
        for req in group:
            self._requests[req.request_id] = req
            self.scheduler.add(req)
        return group_id

    def check_request(self, prompt_ids: list[int], params: SamplingParams,
                      images: list[ImageItem] | None = None, wait_for_grammar: bool = True) -> int | None:
        """Raise UserInputError if the request can never run (too long, larger than the KV budget,
        or naming tokens the model does not have). Returns the most prompt tokens it may prefill in
        one step when it fits only in chunks smaller than `max_num_batched_tokens`, else None.
        A structured request's grammar is compiled (on a worker thread, cached) and, with
        `wait_for_grammar`, waited for, so that a bad spec fails here; without, only a compile that
        has already failed does (the engine thread never waits: a later failure fails the request)."""
        params.validate()
        if params.structured_output is not None:
            grammar = self.grammars.submit(params.structured_output)
            if wait_for_grammar or grammar.done():
                grammar.result()
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise UserInputError(f"prompt is {n} tokens long; max_model_len is {self.max_model_len}, "
                                 "which must leave room for at least one generated token")
        vocab = self.model.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise UserInputError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab})")
        image_id = self.image_layout.image_token_id if images else None
        if prompt_ids and (min(prompt_ids) < 0 or max((t for t in prompt_ids if t != image_id), default=0) >= vocab):
            raise UserInputError(f"prompt token ids must be in [0, {vocab})")
        if self.image_layout is not None and not images and self.image_layout.image_token_id in prompt_ids:
            raise UserInputError("the prompt holds image tokens but no images")
        peak = min(n + params.max_tokens, self.max_model_len)
        chunk = self.config.max_num_batched_tokens
        fitting = self.kv.max_chunk(peak, chunk)
        if fitting == chunk:
            return None
        if images and fitting < max(im.length for im in images):
            fitting = 0   # an image is never split across chunks: it must fit one
        if fitting:
            log.info("a request of %d tokens fits the KV cache only in prefill chunks of %d tokens", peak, fitting)
            return fitting
        need = self.kv.peak_pages(peak, 1)
        why = " (its pinned pool split leaves one side too small)" if need <= self.kv.num_pages else ""
        raise UserInputError(f"request needs {format_bytes(need * self.kv.page_bytes)} of KV cache for {peak} tokens, "
                             f"but the KV cache has {format_bytes(self.kv.num_pages * self.kv.page_bytes)}{why}; "
                             "raise --kv-cache-memory or lower max_tokens")

    def request(self, request_id: str) -> Request:
        """An unfinished engine request by its engine id (a group of n > 1 has ids "<id>#<index>")."""
        return self._requests[request_id]

    def shutdown(self) -> None:
        """Stop what the executor started (tensor-parallel workers); also runs at interpreter exit."""
        self.executor.shutdown()

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
            outputs.append(self._output(req))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass. Returns an output for every completion that produced text or
        finished in it (its `delta_*` fields hold what is new).

        Asynchronous scheduling: step N+1 is scheduled and launched before step N's sampled ids are
        read back, so the device never waits for the host; the outputs returned are step N's (one
        step behind), and a final call with nothing left to schedule collects the last one."""
        if self._build is not None:
            self.poll_compile()
        plan = self.scheduler.schedule()
        launched = None
        if plan.seqs:
            launched = self._launch(plan)
        else:
            self.runner.apply(plan)   # requests may still have left
            compiling = [r.grammar for r in self.scheduler.waiting if r.grammar is not None and not r.grammar.done()]
            if compiling and self._inflight is None:   # nothing else to do: wait a little, not spin
                futures.wait(compiling, timeout=GRAMMAR_POLL_S, return_when=futures.FIRST_COMPLETED)
            elif self.scheduler.waiting and not self.scheduler.running and self._inflight is None:
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
        outputs = []
        for req in self.scheduler.update_from_output(plan, result):
            if req.is_finished:
                self._retire(req)
            outputs.append(self._output(req))
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

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(req.group_id, req.prompt, req.prompt_token_ids, [req.take_output()], req.is_finished,
                             req.num_cached_tokens)


@dataclass
class _Done:
    """A step that already has its result (it failed and was rerun one sequence at a time)."""

    result: StepResult

    def resolve(self) -> StepResult:
        return self.result
