"""From `--model` (alias, .gguf file, Hugging Face checkpoint directory or Hub name) to a model and tokenizer."""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserInputError
from ..hostmem import release_freed_memory
from .base import CausalLM
from .embedded import EMBEDDED_MODELS, cache_dir, resolve_embedded
from .hub import HubFormat, HubModel, HubOptions, HubSpec, fetch, fetch_file
from .registry import model_class_for_gguf, model_class_for_hf
from .tensor_parallel import ShardPlan, Slice, TensorParallelShard, check_shardable, parallelize, shard_model
from . import quant_cache
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A checkpoint's tensors in our names; a tensor-parallel rank gets the plan of its slices.
Weights = Callable[[CausalLM, "ShardPlan | None"], Iterator[tuple[str, torch.Tensor]]]


class SourceKind(enum.Enum):
    GGUF = "gguf"
    HF_DIR = "hf_dir"


@dataclass(frozen=True)
class ModelSource:
    name: str          # what the user asked for
    kind: SourceKind
    path: Path
    hub: HubModel | None = None   # where a Hub name was fetched from (models/hub.py)


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    source: ModelSource
    load_seconds: float
    weight_formats: dict[str, int] | None = None   # quantised modules per format (None: dtype as asked)


def resolve_model(name: str, hub: HubOptions = HubOptions()) -> ModelSource:
    """A local path wins over a Hub name of the same spelling; an alias wins over both."""
    local = _resolve_local(name)
    if local is not None:
        if hub.given:
            raise UserInputError(f"{' and '.join(hub.given)} go with a Hugging Face Hub name; {name!r} is "
                                 f"{'a known alias' if name in EMBEDDED_MODELS else 'a local path'}")
        return local
    spec = HubSpec.parse(name, hub)
    if spec is None:
        aliases = ", ".join(EMBEDDED_MODELS)
        raise UserInputError(f"model {name!r} is neither a known alias ({aliases}), an existing .gguf file or "
                             "checkpoint directory, nor a Hugging Face Hub name (ORG/NAME)")
    model = fetch(spec)
    kind = SourceKind.HF_DIR if model.format is HubFormat.CHECKPOINT else SourceKind.GGUF
    return ModelSource(name, kind, model.path, model)


def _resolve_local(name: str) -> ModelSource | None:
    if name in EMBEDDED_MODELS:
        return ModelSource(name, SourceKind.GGUF, resolve_embedded(name))
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserInputError(f"model file {name!r} is not a .gguf file")
        return ModelSource(name, SourceKind.GGUF, path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserInputError(f"model directory {name!r} has no config.json")
        return ModelSource(name, SourceKind.HF_DIR, path)
    return None


def load_model(name: str, dtype: torch.dtype, device: torch.device, quantized: bool = False,
               shard: TensorParallelShard | None = None, quantization: str = "auto",
               mmproj: str | None = None, hub: HubOptions = HubOptions()) -> LoadedModel:
    """`hub`: how to fetch a Hub name (models/hub.py). `quantized` (CPU, fp32 activations): a GGUF file's weights stay quantised (`quant.py`).
    `shard`: load this tensor-parallel rank's slices only (models/tensor_parallel.py).
    `quantization` (`--quantization`): auto = what a checkpoint declares (compressed-tensors), compressed-tensors
    = the same but the checkpoint must declare it, fp8 = a float checkpoint's projections to FP8 at load, none =
    float weights only (a quantised checkpoint is refused). For a GGUF file on CUDA (bf16/fp16), auto keeps its
    Q4_0/Q4_1/Q4_K projections 4-bit and its Q8_0/Q6_K ones 8-bit (gguf_packed.py) and none dequantises every
    weight. `mmproj` (`--mmproj`): llama.cpp's file of a GGUF model's image encoder and, where it holds
    one, audio encoder (Gemma 4; gemma4_vision.py, gemma4_audio.py)."""
    start = time.perf_counter()
    source = resolve_model(name, hub)
    mmproj_path = _mmproj_path(mmproj, source, shard)
    if device.type == "cpu":   # the kernels' library compiles (a first start) while the weights load
        from . import cpu_library

        cpu_library.prepare()
    log.info("loading %s from %s", name, source.path)
    formats = None
    if source.kind is SourceKind.GGUF:
        if quantization in ("fp8", "compressed-tensors"):
            raise UserInputError(f"--quantization {quantization} needs a Hugging Face checkpoint directory; "
                                 f"{name!r} is a GGUF file (its own quantisation is read as saved: use auto)")
        from .gguf_packed import keeps_packed

        model, tokenizer, formats = _load_gguf(source.path, dtype, device, quantized, shard,
                                               keeps_packed(device, dtype, quantization, shard), mmproj_path)
    else:
        model, tokenizer, formats = _load_hf_dir(source.path, dtype, device, shard, quantization)
    if shard is not None:
        parallelize(model, model.tensor_parallel_plan)
    if device.type == "cpu":   # before any step: a process computes its norms one way only (cpu_kernels.py)
        t = time.perf_counter()
        why = cpu_library.load()
        if why is not None:
            log.info("CPU ops run their Python kernels: %s", why)
        elif time.perf_counter() - t > 1:
            log.info("CPU ops' C++ kernels: waited %.0f s for their build (once per machine and torch)",
                     time.perf_counter() - t)
        from . import cpu_invariance

        cpu_invariance.check()   # logs a warning where this host's kernels make a row follow its batch
    return LoadedModel(model.eval(), tokenizer, source, time.perf_counter() - start, formats)


def _mmproj_path(mmproj: str | None, source: ModelSource, shard: TensorParallelShard | None) -> Path | None:
    if mmproj is None:
        return None
    path = Path(mmproj).expanduser()
    if source.hub is not None and source.kind is SourceKind.GGUF and not path.exists():
        path = fetch_file(source.hub, mmproj)   # a file of the model's own repository
    if source.kind is not SourceKind.GGUF:
        raise UserInputError(f"--mmproj goes with a .gguf model; {source.name!r} is a checkpoint directory, whose "
                             "own config says which encoders it has")
    if not path.exists():
        raise UserInputError(f"--mmproj {mmproj!r}: no such file")
    if not path.is_file() or path.suffix.lower() != ".gguf":
        raise UserInputError(f"--mmproj {mmproj!r} is not a .gguf file")
    if shard is not None:
        raise UserInputError("--mmproj is not supported with tensor parallelism yet")
    return path


def build_model(model_class: type[CausalLM], config, weights: Weights, dtype: torch.dtype, device: torch.device,
                shard: TensorParallelShard | None = None, deferred: Collection[str] = ()) -> CausalLM:
    """Instantiate on the target device in the target dtype (no random init), then fill it from
    `weights(model, plan)` (our tensor names: the model maps checkpoint names itself). A
    tensor-parallel rank builds with full shapes on the CPU (untouched memory costs nothing), takes
    its local shapes on the device, then reads only its slices. `deferred`: parameters `weights` leaves to the
    caller (CausalLM.load_weights)."""
    if shard is None:
        with torch.device(device):
            model = model_class(config, dtype)
        model.load_weights(weights(model, None), deferred)
        return model
    model = model_class(config, dtype)
    model.tensor_parallel_plan = shard_model(model, shard, device)
    model.load_weights(weights(model, model.tensor_parallel_plan))
    return model


def check_tensor_parallel(name: str, tp: int, hub: HubOptions = HubOptions()) -> None:
    """UserInputError if model `name` cannot be split over `tp` ranks; reads only its config (the
    model is built on the meta device, no weights; a Hub name is fetched, once for every rank)."""
    source = resolve_model(name, hub)
    if source.kind is SourceKind.GGUF:
        from .gguf_file import GGUFFile

        gguf = GGUFFile(source.path)
        model_class = model_class_for_gguf(gguf.get("general.architecture"))
        config = model_class.config_class.from_gguf(gguf)
    else:
        model_class, config = _hf_config(source.path)
    with torch.device("meta"):
        check_shardable(model_class(config), tp)


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, quantized: bool,
               shard: TensorParallelShard | None, keep_packed: bool = False,
               mmproj: Path | None = None) -> tuple[CausalLM, Tokenizer, dict[str, int] | None]:
    """A tensor-parallel rank dequantises each tensor whole, then keeps its slice (GGUF blocks do
    not align with every slice; the exact 4-bit groups are sliced where they do). `keep_packed`
    (gguf_packed.keeps_packed: CUDA): 4-bit and 8-bit projections become QuantizedLinears on `device`, the rest
    is dequantised to `dtype`. `mmproj`: the image (and audio) encoder's file (its tensors dequantised to
    `dtype`)."""
    from .gguf_file import GGUFFile

    gguf = GGUFFile(path)
    model_class = model_class_for_gguf(gguf.get("general.architecture"))
    config = model_class.config_class.from_gguf(gguf)
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    tokenizer = Tokenizer.from_gguf(gguf, cache_dir() / "tokenizers" / f"{key}.json")
    proj = None
    if mmproj is not None:
        from .gemma4 import Gemma4ForCausalLM
        from .gemma4_vision import Gemma4ForConditionalGeneration, Gemma4VisionConfig

        if model_class is not Gemma4ForCausalLM:
            raise UserInputError(f"--mmproj is supported for Gemma 4 GGUF files; {path.name} is "
                                 f"{gguf.get('general.architecture')!r}")
        proj = GGUFFile(mmproj)
        config = Gemma4VisionConfig.from_gguf(config, proj, tokenizer)
        model_class = Gemma4ForConditionalGeneration
    # Only a file with quantised matrices is kept quantised: an F32/F16 file keeps its exact weights.
    quantized = quantized and any(t.quant_type not in ("F32", "F16", "BF16") for t in gguf.tensors())
    int4 = {}
    kept: set[str] = set()   # GGUF tensors held packed by QuantizedLinears (keep_packed): never dequantised
    # Q8_0 embedding tables kept quantised (CPU): their exact int8 blocks, never dequantised (the 262k-row
    # table's fp32 copy and its quantisation back to the same blocks took ~10 s of a first start)
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def weights(model: CausalLM, plan: ShardPlan | None) -> Iterator[tuple[str, torch.Tensor]]:
        for t in gguf.tensors():
            name, one_plus_w = model.gguf_name(t.name)
            if name is None or t.name in kept:
                continue
            part = plan.slice_for(name) if plan is not None else None
            if quantized and part is None and t.quant_type == "Q8_0" and _is_table(model, name):
                q8 = gguf.int8_groups(t.name)
                tables[name] = (q8.q, q8.scale)
                continue
            if quantized and (groups := gguf.int4_groups(t.name)) is not None:
                groups = groups if part is None else part.read_int4(groups)
                if groups is not None:
                    int4[name] = groups
            tensor = gguf.load(t.name)
            if part is not None:
                tensor = part.read(tensor)
            yield name, tensor - 1.0 if one_plus_w else tensor  # GGUF stores Gemma 3 norms as 1 + w
        for t in proj.tensors() if proj is not None else ():
            name, tensor = model.mmproj_tensor(t.name, proj.load(t.name))
            if name is not None:
                yield name, tensor

    formats = None
    cache_file = _quant_cache_file(path, quantized, dtype, device, shard) if proj is None else None
    cached = quant_cache.load(cache_file, model_class, config) if cache_file else None
    if cached is not None:
        model, formats = cached
        log.info("quantised weights loaded from %s", cache_file)
    elif keep_packed:
        model, formats = _build_gguf_packed(model_class, config, gguf, weights, dtype, device, kept)
    else:
        model = build_model(model_class, config, weights, dtype, device, shard, deferred=tables.keys())
        release_freed_memory()   # the dequantised tensors just copied into the model (hostmem.py)
    if quantized and cached is None:
        from .quant import quantize_model

        log.info("quantising the weights for the CPU kernels (once: later starts load them from the cache)")
        record = {} if cache_file else None
        formats = quantize_model(model, int4, record=record, tables=tables)
        release_freed_memory()
        if cache_file:
            quant_cache.save(cache_file, model, record, formats)
    return model, tokenizer, formats


def _is_table(model: CausalLM, name: str) -> bool:
    """Whether parameter `name` is an embedding table's weight (a stacked part, like q_proj, has no module)."""
    from .layers import Embedding

    module, _, leaf = name.rpartition(".")
    try:
        return leaf == "weight" and isinstance(model.get_submodule(module), Embedding)
    except AttributeError:
        return False


def _build_gguf_packed(model_class: type[CausalLM], config, gguf, weights: Weights, dtype: torch.dtype,
                       device: torch.device, kept: set[str]) -> tuple[CausalLM, dict[str, int] | None]:
    """Built on the CPU (untouched torch.empty pages cost nothing), the packed projections swapped for
    QuantizedLinears (4-bit MoE expert tensors: QuantizedExperts) on the device before any float weight of theirs
    exists, the rest moved, then filled from the other tensors (`kept` tells `weights` which to skip)."""
    from . import gguf_packed
    from .quantized import formats

    model = model_class(config, dtype)
    planned = gguf_packed.plan_packed(model, gguf)
    experts = gguf_packed.plan_int4_experts(model, gguf)
    kept.update(name for entry in planned.values() for name in entry.tensors)
    kept.update(name for entry in experts.values() for name in entry.tensors)
    quants = gguf_packed.install_packed(model, gguf, planned, device)
    quants |= gguf_packed.install_int4_experts(model, gguf, experts, device, dtype)
    model.to(device)
    model.load_weights(weights(model, None))
    release_freed_memory()   # the dequantised tensors just copied into the model (hostmem.py)
    return model, formats(model, quants, dtype) if quants else None   # None: no packed projection, all as `dtype`


def _quant_cache_file(path: Path, quantized: bool, dtype: torch.dtype, device: torch.device,
                      shard: TensorParallelShard | None) -> Path | None:
    """Where a quantised CPU load keeps its weights (quant_cache.py); None where it keeps none."""
    if not quantized or shard is not None or device.type != "cpu" or dtype != torch.float32:
        return None
    if os.environ.get("GEMMASERVE_QUANT_CACHE", "1") == "0":
        return None
    return quant_cache.cache_path(path)


def _hf_config(path: Path) -> tuple[type[CausalLM], object]:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{path / 'config.json'} is not valid JSON: {exc}") from exc
    model_class = model_class_for_hf(cfg.get("architectures"), cfg.get("model_type"))
    processor = _processor_config(path)
    if processor:   # how the checkpoint prepares audio (and images): its models read it as "_processor"
        cfg["_processor"] = processor
    return model_class, model_class.config_class.from_hf(cfg)


PROCESSOR_PARTS = ("feature_extractor", "image_processor", "video_processor")


def _processor_config(path: Path) -> dict:
    """The checkpoint's processor settings, by part ("feature_extractor", "image_processor", "video_processor"):
    processor_config.json (one entry per part), then the files transformers saves each part in alone
    (preprocessor_config.json: the feature extractor or the image processor, by its type;
    video_preprocessor_config.json); a part found twice is taken from the first."""
    parts: dict = {}
    for name in ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise UserInputError(f"{file} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise UserInputError(f"{file} must hold a JSON object")
        if name == "processor_config.json":
            found = {k: v for k, v in raw.items() if k in PROCESSOR_PARTS and isinstance(v, dict)}
        elif name == "video_preprocessor_config.json":
            found = {"video_processor": raw}
        else:
            kind = "feature_extractor" if "FeatureExtractor" in str(raw.get("feature_extractor_type", "")) else \
                "image_processor"
            found = {kind: raw}
        parts = {**found, **parts}
    return parts


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device, shard: TensorParallelShard | None,
                 quantization: str = "auto") -> tuple[CausalLM, Tokenizer, dict[str, int] | None]:
    """A tensor-parallel rank reads only its slices from the files (safetensors' `get_slice`). A checkpoint
    with a compressed-tensors `quantization_config` keeps its quantised Linears quantised (models/quantized.py;
    a rank's slices of their packed tensors: models/quantized_shards.py); `quantization` "fp8" quantises a float
    one's projections at load (a rank its own slices)."""
    from safetensors import SafetensorError, safe_open

    from . import quantized as q
    from .quantized_shards import quantized_slices

    model_class, config = _hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserInputError(f"model directory {str(path)!r} has no *.safetensors files")
    plan = _quant_plan(path, quantization)
    index: dict[str, q.TensorInfo] = {}
    if plan is not None:
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as fh:
                    for raw_name in fh.keys():
                        sl = fh.get_slice(raw_name)
                        index[raw_name] = q.TensorInfo(sl.get_dtype(), tuple(sl.get_shape()))
            except SafetensorError as exc:
                raise UserInputError(f"cannot read {file}: {exc}") from None
    kept: set[str] = set()   # our quantised modules: their tensors are copied as saved (int32, fp8, scales)
    kept_slices: dict[str, Slice | None] = {}   # a rank's slices of those tensors (in their packed units)

    def weights(model: CausalLM, plan_: ShardPlan | None) -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as fh:
                    for raw_name in fh.keys():
                        name = model.checkpoint_name(raw_name)
                        if name is None:
                            continue
                        if name.endswith(".weight_shape"):   # checked, then dropped: the module knows its shape
                            q.check_weight_shape(raw_name, fh.get_tensor(raw_name), index)
                            continue
                        part = kept_slices[name] if name in kept_slices else \
                            plan_.slice_for(name) if plan_ is not None else None
                        tensor = fh.get_tensor(raw_name) if part is None else part.read(fh.get_slice(raw_name))
                        keep = kept and q.our_module(model, name)[0] in kept
                        yield name, tensor if keep else tensor.to(torch.float32)
            except SafetensorError as exc:   # a damaged or truncated file
                raise UserInputError(f"cannot read {file}: {exc}") from None

    formats = None
    if plan is None and quantization == "fp8" and shard is None:
        # Built on the CPU (untouched torch.empty pages cost nothing); everything but the projections and MoE experts
        # moved to the device; those filled on the CPU, then each moved and quantised in turn: the device never holds
        # more than one float projection or experts block (a 31B's bf16 weights would take 62 GB of it).
        model = model_class(config, dtype)
        _to_device_except(model, set(q.projection_names(model)) | set(q.expert_block_names(model)), device)
        model.load_weights(weights(model, None))
        quantized = q.quantize_fp8_online(model, device=device)
        release_freed_memory()
        formats = q.formats(model, quantized, dtype)
    elif plan is None:
        model = build_model(model_class, config, weights, dtype, device, shard)
        if quantization == "fp8":   # a tensor-parallel rank: its own slices, built on the device
            quantized = q.quantize_fp8_online(model, model.tensor_parallel_plan)
            release_freed_memory()
            formats = q.formats(model, quantized, dtype)
    else:
        # Built on the CPU (untouched torch.empty pages cost nothing), a rank's local shapes taken there too, the
        # planned Linears swapped for quantised ones on the device before any float weight of theirs exists, the
        # rest moved, then filled.
        model = model_class(config, dtype)
        shard_plan = shard_model(model, shard, torch.device("cpu")) if shard is not None else None
        planned = q.plan_modules(model, plan, index)
        if shard_plan is not None:   # misaligned shares are refused here, before anything is read
            kept_slices.update(quantized_slices(model, planned, shard_plan, index))
            model.tensor_parallel_plan = shard_plan
        q.install(model, planned, device)
        kept.update(planned)
        model.to(device)
        model.load_weights(weights(model, shard_plan))
        q.finish(model, planned)
        formats = q.formats(model, {n: e.quant for n, e in planned.items()}, dtype)
    return model, Tokenizer.from_checkpoint_dir(path), formats


def _to_device_except(model: torch.nn.Module, staged: set[str], device: torch.device) -> None:
    """Every parameter and buffer of `model` to `device` except those of the modules named in `staged`."""
    for name, module in model.named_modules():
        if name in staged:
            continue
        for key, p in module._parameters.items():
            if p is not None:
                module._parameters[key] = torch.nn.Parameter(p.data.to(device), requires_grad=False)
        for key, b in module._buffers.items():
            if b is not None:
                module._buffers[key] = b.to(device)


def _quant_plan(path: Path, quantization: str):
    """The checkpoint's compressed-tensors plan as `--quantization` takes it (None: load the weights as floats);
    impossible combinations are errors here, before anything is allocated."""
    from ..quantization.compressed_tensors import QuantPlan

    raw = json.loads((path / "config.json").read_text()).get("quantization_config")
    where = str(path / "config.json")
    if raw is None:
        if quantization == "compressed-tensors":
            raise UserInputError(f"--quantization compressed-tensors: {where} declares no quantization_config")
        return None
    if quantization == "fp8":
        raise UserInputError(f"--quantization fp8 quantises a float checkpoint at load, but {where} is already "
                             f"quantised ({raw.get('quant_method') if isinstance(raw, dict) else raw!r}): use "
                             "--quantization auto")
    if quantization == "none":
        raise UserInputError(f"--quantization none: {where} is quantised and dequantising it at load is not "
                             "supported: use --quantization auto")
    return QuantPlan.from_hf(raw, where)
