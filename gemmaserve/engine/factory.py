"""Assembling an engine from its configuration, in dependency order: executor and weights, KV layer
specs (fp8 scales calibrated), attention backend, batch invariance, cache options, KV manager,
runner, scheduler, the input processor and request validator, and the output processor. `LLMEngine`
receives the parts (keeping them private) and only adds, aborts and steps requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..attention import select_backend
from ..attention.base import AttentionBackend
from ..attention.kv_quant import FP8_DTYPE
from ..config.engine import EngineConfig
from ..config.resolve import (BATCH_INVARIANT_CHANGES, BatchInvariance, CacheOptions, resolve_batch_invariance,
                              resolve_cache_options)
from ..errors import UserInputError
from ..kv import KVCacheManager, LayerSpec, create_kv_manager
from ..models.layers import set_batch_invariant
from ..models.loader import LoadedModel
from ..transfer.runtime import probe as probe_transfer
from .executor.base import create_executor
from .input_processor import InputProcessor
from .kv_calibration import calibrate_kv_scales, calibration_tokens
from .lora import LoRARegistry, LoRASlots, stacked_bytes
from .model_runner import RunnerKV, RunnerOptions
from .output_processor import OutputProcessor
from .scheduler import Scheduler
from .spec_decode.build import draft_model, mtp_drafter
from .spec_decode.draft_model import DraftModelDrafter, offset_specs
from .spec_decode.proposers import create_proposer
from .structured.structured_output import Grammars
from .validation import RequestValidator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileBuild:
    """A background build of compiled CPU decode steps (compile/build_job.py) the engine waits for."""
    pid: int | None       # None: another process runs it
    log_path: str


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
    speculative: str = "off"        # --speculative-config: "ngram k=4 n=4..2"
    kv_offload_bytes: int = 0       # --kv-offload-memory: the host KV tier's size (whole pages)
    vocab_size: int = 0
    kv_transfer_runtime: str | None = None   # disaggregated roles: the resolved KV transfer runtime
    demotions: tuple[str, ...] = ()          # what "auto" resolution turned off, and why
    cpu_compile_build: CompileBuild | None = None


def _weights_label(loaded: LoadedModel, dtype: torch.dtype) -> str:
    formats = loaded.weight_formats
    if not formats:
        return str(dtype).removeprefix("torch.")
    return ", ".join(f"{fmt} x {n}" for fmt, n in formats.items() if n)


@dataclass
class EngineParts:
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    executor: object                 # executor.py: this process, or tensor-parallel workers
    loaded: LoadedModel
    max_model_len: int
    specs: list[LayerSpec]           # one device's KV layers (fp8 scales set)
    kv_heads: list[int]              # every KV layer's heads in the model (a tensor-parallel rank holds a share)
    backend: AttentionBackend
    cache_options: CacheOptions
    kv: KVCacheManager
    grammars: Grammars
    suppressed_token_ids: list[int]
    runner: object                   # ModelRunner, or the tensor-parallel driver's
    scheduler: Scheduler
    loras: LoRARegistry              # adapters by name (the runner holds their weights)
    inputs: InputProcessor
    validator: RequestValidator
    outputs: OutputProcessor
    async_scheduling: bool
    info: EngineInfo


def _media_hint(loaded: LoadedModel, layouts: dict) -> str:
    """A Gemma 4 GGUF file loaded without its mmproj file is text-only: say how to give it images and audio; one
    loaded with an mmproj file that holds no audio encoder (only E2B/E4B's hold one) takes images only: say so."""
    from ..models.gemma4 import Gemma4ForCausalLM
    from ..models.loader import SourceKind
    from ..models.multimodal import Modality

    if loaded.source.kind is not SourceKind.GGUF or not isinstance(loaded.model, Gemma4ForCausalLM):
        return ""
    if not layouts:
        return ("a GGUF file holds the text model only: give the model's mmproj .gguf file with --mmproj for images "
                "(and audio, E2B/E4B)")
    if Modality.AUDIO not in layouts:
        return "its --mmproj file holds no audio encoder (only E2B/E4B's mmproj files hold one)"
    return ""


def assemble(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """`loaded`: reuse weights another engine already loaded (same model, dtype and device)."""
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    executor = create_executor(config)   # tensor parallelism: workers start loading their shards
    if loaded is None:
        loaded = executor.load_model(dtype, device)
    model, tokenizer = loaded.model, loaded.tokenizer
    limit = model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise UserInputError(f"max_model_len {config.max_model_len} exceeds the model's context length {limit}")
    max_model_len = config.max_model_len or limit

    kv_dtype = config.torch_kv_dtype(dtype)
    model_specs = model.kv_layer_specs(kv_dtype)
    specs = executor.local_kv_specs(model_specs)   # one device's KV heads
    if kv_dtype == FP8_DTYPE:
        specs = calibrate_kv_scales(model, specs, calibration_tokens(tokenizer, model.vocab_size), device)
    draft = draft_model(config, loaded, dtype, device)
    if draft is not None:   # its KV layers follow the target's: one pool, one budget
        model_specs = model_specs + draft.model.kv_layer_specs(kv_dtype)
        draft_specs = executor.local_kv_specs(draft.model.kv_layer_specs(kv_dtype))
        if kv_dtype == FP8_DTYPE:
            draft_specs = calibrate_kv_scales(draft.model, draft_specs,
                                              calibration_tokens(tokenizer, draft.model.vocab_size), device)
        first_draft_layer = len(specs)
        specs = specs + offset_specs(draft_specs, first_draft_layer)
    backend = select_backend(config.attention_backend, device, specs)
    invariance = resolve_batch_invariance(config, device.type, backend.capabilities, bool(loaded.weight_formats))
    backend.batch_invariant = invariance is BatchInvariance.KERNELS
    set_batch_invariant(model, backend.batch_invariant)   # reused weights follow this engine
    if backend.batch_invariant:
        log.info("batch invariant: %s", "; ".join(BATCH_INVARIANT_CHANGES))
    elif config.batch_invariant:
        log.info("batch invariant: every CPU step is (row-independent kernels, blockwise attention)")
    drafter = mtp_drafter(config, model, backend, dtype, device) if draft is None else DraftModelDrafter(
        draft.model, backend, first_draft_layer, tokenizer.pad_token_id or 0)
    cache_options = resolve_cache_options(config, model.engine_preferences(), backend.capabilities, specs,
                                          probe=lambda name: probe_transfer(name, device))
    budget = config.kv_budget_bytes(device)
    if device.type == "cuda" and config.lora_modules and config.kv_cache_memory is None:
        # The adapters' stacked device slots are allocated at the first one's load: leave them room.
        reserve = stacked_bytes(model, config.max_loras, config.max_lora_rank, dtype)
        log.info("LoRA: %.0f MiB of the KV budget kept for %d adapter slots of rank %d", reserve / 2**20,
                 config.max_loras, config.max_lora_rank)
        budget = max(0, budget - reserve)
    kv = create_kv_manager(cache_options.kv_cache_manager, specs, config.page_size, budget,
                           enable_prefix_caching=cache_options.enable_prefix_caching,
                           enable_scratch=cache_options.swa_scratch_reuse, sliding_share=config.kv_pool_split,
                           lookback=0 if drafter is None else drafter.lookback,
                           offload_bytes=config.kv_offload_memory or 0)
    use_graphs = device.type == "cuda" and not config.enforce_eager and backend.capabilities.cuda_graphs
    layouts = {m: layout.with_texts(tokenizer.special_text) for m, layout in model.media_layouts().items()} \
        if hasattr(model, "media_layouts") else {}
    for layout in layouts.values():   # a request with a larger item is refused (input_processor)
        if config.max_num_batched_tokens < layout.max_tokens:
            log.warning("max_num_batched_tokens %d is below the %d tokens one %s input can take: larger ones will be "
                        "refused (an item is never split across prefill chunks)", config.max_num_batched_tokens,
                        layout.max_tokens, layout.modality.value)
    # A text-only model has seen media tokens only as tokens, never with their embeddings: left
    # free it may emit them (the 270M base model answers a haiku prompt with <start_of_image> x 24).
    suppress = config.suppress_media_tokens
    if suppress is None:
        suppress = not model.config.multimodal
    suppressed = sorted(t for t in tokenizer.media_token_ids if t < model.vocab_size) if suppress else []
    grammars = Grammars(tokenizer, model.vocab_size)   # built on first use
    spec = config.speculative_config.for_device(device.type) if config.speculative_config else None
    runner_kv = RunnerKV(kv.layout, kv.groups, kv.layer_slot, specs,
                         host_kv_pages=kv.tier.num_pages if kv.tier is not None else 0)
    options = RunnerOptions(
        max_model_len=max_model_len, max_batch=config.max_num_seqs, cuda_graphs=use_graphs,
        encoder_cache_bytes=config.encoder_cache_memory, suppress_token_ids=tuple(suppressed),
        speculative_tokens=spec.num_speculative_tokens if spec else 0,
        speculative_batch=spec.disable_by_batch_size if spec else 0, max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras or max(config.max_loras, len(config.lora_modules or {})))
    runner = executor.create_runner(model, backend, device, runner_kv, options, grammars, drafter)
    async_scheduling = config.async_scheduling == "on" or (config.async_scheduling == "auto" and device.type == "cuda")
    info = EngineInfo(
        model=config.model, device=str(device), dtype=str(dtype).removeprefix("torch."),
        weights=_weights_label(loaded, dtype), kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        max_model_len=max_model_len, kv_manager=kv.name, swa_scratch_reuse=cache_options.swa_scratch_reuse,
        prefix_caching=cache_options.enable_prefix_caching, attention_backend=backend.capabilities.name,
        cuda_graphs=runner.graphs is not None, cpu_compile="off", async_scheduling=async_scheduling,
        kv_pages=kv.num_pages, kv_page_size=kv.page_size, kv_bytes=kv.num_pages * kv.page_bytes,
        load_seconds=loaded.load_seconds, tensor_parallel_size=config.tensor_parallel_size,
        batch_invariant=invariance is not BatchInvariance.OFF,
        speculative="off" if spec is None else spec.label,
        kv_offload_bytes=kv.tier.num_pages * kv.tier.page_bytes if kv.tier is not None else 0,
        vocab_size=model.vocab_size, kv_transfer_runtime=cache_options.kv_transfer_runtime,
        demotions=tuple(cache_options.demotions))
    validator = RequestValidator(model.vocab_size, max_model_len, config.max_num_batched_tokens, kv, grammars, layouts)
    return EngineParts(
        config=config, device=device, dtype=dtype, executor=executor, loaded=loaded, max_model_len=max_model_len,
        specs=specs, kv_heads=[s.num_kv_heads for s in model_specs], backend=backend, cache_options=cache_options, kv=kv, grammars=grammars,
        suppressed_token_ids=suppressed, runner=runner,
        scheduler=Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens,
                            create_proposer(spec), spec.disable_by_batch_size if spec else 1,
                            LoRASlots(config.max_loras)),
        loras=LoRARegistry(model, config.max_lora_rank),
        inputs=InputProcessor(config.model, tokenizer, layouts, _media_hint(loaded, layouts)), validator=validator,
        outputs=OutputProcessor(tokenizer), async_scheduling=async_scheduling, info=info)
