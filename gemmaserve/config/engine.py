"""Engine configuration: the options of DESIGN.md §2, parsed once and shared by every command."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UserInputError
from ..hostmem import available_host_memory
from ..models.embedded import DEFAULT_MODEL
from ..models.hub import HubOptions
from ..units import format_bytes
from .options import argparse_type, number, option, positive_int, refusing, size
from .speculative import SpeculativeConfig

if TYPE_CHECKING:   # torch is imported only when a dtype or device is resolved: `--help` stays fast
    import torch

    from .kv_transfer import KVTransferConfig

# Names of torch dtypes, looked up on first use. Only what works is offered; float16 is refused with its reason.
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
DTYPE_CHOICES = ("auto", *_DTYPES)
_FP16_REFUSAL = "overflows on Gemma activations (values beyond 65504); use bfloat16 or float32"
_REFUSED_DTYPES = {name: f"dtype {name} {_FP16_REFUSAL}" for name in ("float16", "fp16", "half")}
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_MANAGERS = ("auto", "v1", "v2")
SCRATCH_CHOICES = ("auto", "on", "off")
# KV storage: auto = the model's dtype; fp8 = e4m3 with per-layer scales (engine/kv_calibration.py).
_KV_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
              "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
KV_DTYPE_CHOICES = ("auto", *_KV_DTYPES)
# Weights: auto = as the checkpoint declares (compressed-tensors); fp8 = a float checkpoint quantised at load.
QUANTIZATION_CHOICES = ("auto", "none", "fp8", "compressed-tensors")

# CPU default KV budget. Storage is torch.empty, so untouched pages cost no RAM.
_CPU_KV_DEFAULT = 4 << 30
# GPU memory kept free for activations and sampling buffers.
_GPU_ACTIVATION_RESERVE = 1 << 30


def _lora_modules(value) -> dict[str, str] | None:
    """{name: path} from a dict or from NAME=PATH strings (the command line's form)."""
    if value is None or value == {} or value == []:
        return None
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        pairs = []
        for v in value:
            name, eq, path = v.partition("=")
            if not eq or not name.strip() or not path.strip():
                raise UserInputError(f"lora_modules: {v!r} is not NAME=PATH (on the command line, --lora-modules "
                                     "takes every word after it: put prompts before it)")
            pairs.append((name.strip(), path.strip()))
    else:
        raise UserInputError(f"lora_modules must map names to adapter directories, got {value!r}")
    out: dict[str, str] = {}
    for name, path in pairs:
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise UserInputError(f"lora_modules: {name!r} -> {path!r} is not a name and a directory")
        if name in out:
            raise UserInputError(f"lora_modules: the name {name!r} is given twice")
        out[name] = path
    return out


@dataclass
class EngineConfig:
    model: str = option(DEFAULT_MODEL, help="model alias, .gguf file, Hugging Face checkpoint directory or Hub name "
                                            "(ORG/NAME, ORG/NAME:FILE.gguf: fetched into the Hugging Face cache)")
    revision: str | None = option(None, help="with a Hub name: the branch, tag or commit to fetch (default: main)")
    gguf_file: str | None = option(None, help="with a Hub name of a GGUF repository: which .gguf file to fetch")
    hf_token: str | None = option(None, help="with a Hub name: the token for gated or private repositories "
                                             "(default: $HF_TOKEN or the saved login)")
    download_dir: str | None = option(None, help="with a Hub name: the Hugging Face cache directory to use "
                                                 "(default: $HF_HUB_CACHE, else $HF_HOME/hub)")
    mmproj: str | None = option(None, help="with a Gemma 4 .gguf model: llama.cpp's mmproj .gguf file of its image "
                                           "encoder (and audio encoder, E2B/E4B), so that requests may carry images "
                                           "and video (and audio) (without it a GGUF model is text-only)")
    dtype: str = option("auto", choices=DTYPE_CHOICES, parse=refusing(_REFUSED_DTYPES),
                        help="weight and activation dtype; auto = bfloat16 on CUDA, float32 on the CPU with a "
                             "GGUF file's quantised weights kept quantised (int8/int4 CPU kernels); float32 = "
                             "every weight expanded to fp32 (the exact reference path)")
    device: str = option("auto", help="torch device (cpu, cuda, cuda:1); auto = cuda if available")
    quantization: str = option(
        "auto", choices=QUANTIZATION_CHOICES,
        help="quantised weights of a checkpoint directory: auto = as its config.json declares (compressed-tensors "
             "W4A16 int4 groups, or FP8 per channel or in blocks with per-token activations; none if it declares "
             "nothing); compressed-tensors = the same, an error if it declares nothing; fp8 = quantise a float "
             "checkpoint's attention and MLP projections to FP8 per channel at load (nothing saved); none = float "
             "weights only (a quantised checkpoint is refused). GGUF files: on CUDA auto keeps their Q4_0, Q4_1 "
             "and Q4_K projections 4-bit and their Q8_0 and Q6_K ones 8-bit (the int4 / int8 kernels; other types "
             "dequantised to --dtype) and none dequantises every weight; on the CPU --dtype decides (fp8 and "
             "compressed-tensors are refused for GGUF)")
    max_model_len: int | None = option(None, parse=positive_int,
                                       help="longest sequence (prompt + output); default: the model's context length")
    max_num_seqs: int = option(64, parse=positive_int, help="most sequences in one batch")
    max_num_batched_tokens: int = option(2048, parse=positive_int,
                                         help="most tokens in one forward pass (longer prompts are chunked)")
    page_size: int = option(16, parse=positive_int, help="tokens per KV page")
    kv_cache_memory: int | None = option(None, parse=size,
                                         help="hard cap on KV cache bytes, e.g. 64MiB or 2GiB "
                                              "(default: 4GiB on the CPU, --gpu-memory-utilization on CUDA)")
    kv_offload_memory: int | None = option(
        None, parse=size,
        help="host memory for KV blocks the prefix cache evicts from the device, e.g. 8GiB: a later prompt with "
             "the same prefix copies them back instead of recomputing them (pinned memory on CUDA); sliding "
             "layers keep only the window tails a resumption reads. Default: none")
    gpu_memory_utilization: float = option(0.9, parse=number,
                                           help="fraction of GPU memory the engine may use (weights + KV)")
    kv_cache_manager: str = option("auto", choices=KV_MANAGERS,
                                   help="KV cache manager: v1 keeps every token in every layer, v2 keeps only what "
                                        "sliding windows can still read; auto = the model's preference (Gemma: v2)")
    swa_scratch_reuse: str = option("auto", choices=SCRATCH_CHOICES,
                                    help="write prefill blocks that leave the window within the chunk to scratch pages "
                                         "shared by the sliding layers; auto = on for text models when supported")
    kv_cache_dtype: str = option("auto", choices=KV_DTYPE_CHOICES,
                                 help="KV cache storage: auto = the model's dtype; fp8 = e4m3 with one scale per "
                                      "layer for K and one for V (half the bytes of bf16: twice the tokens)")
    enable_prefix_caching: bool | None = option(None, negatable=True,
                                                help="reuse the KV of earlier prompts' common prefixes (default: on "
                                                     "where the KV manager supports it)")
    async_scheduling: str = option("auto", choices=SCRATCH_CHOICES,
                                   help="schedule and prepare step N+1 on the host while step N runs on the device "
                                        "(sampled ids stay on the device); auto = on for CUDA, off on the CPU")
    enforce_eager: bool = option(False, help="never use CUDA graphs or compiled CPU decode steps (decode steps are "
                                             "captured by default on CUDA)")
    cpu_compile: str = option("auto", choices=SCRATCH_CHOICES,
                              help="compiled CPU decode steps (AOTInductor packages of the decode step, kept in the "
                                   "cache directory; the same tokens as eager steps, bit for bit). auto (quantised "
                                   "weights): loaded in seconds when the cache has them, else built by a background "
                                   "process (minutes on 2 cores; needs a C++ compiler) while steps run eagerly, "
                                   "switching when ready; on: built before the first step; off: always eager. "
                                   "GEMMASERVE_BACKGROUND_COMPILE=0 stops auto from starting a build")
    attention_backend: str = option("auto", choices=ATTENTION_BACKENDS,
                                    help="attention implementation; auto = triton on CUDA, torch on the CPU")
    encoder_cache_memory: int = option(256 << 20, parse=size,
                                       help="image encoder outputs kept across requests, by image content (0: none; "
                                            "a request always keeps its own until it finishes)")
    suppress_media_tokens: bool | None = option(
        None, negatable=True,
        help="never sample the tokenizer's image/audio/video placeholder tokens (default: on for text-only models)")
    batch_invariant: bool = option(
        False,
        help="a request's logits bitwise the same whatever else is in its batch, the batch size, its place in "
             "it, how its prompt was chunked (chunked prefill, prefix-cache hits) and whether the step ran in a "
             "CUDA graph or compiled. The CPU always is (row-independent kernels; nothing to turn on). CUDA: "
             "every matmul on a Triton GEMM with one tile configuration per shape and no split-K, decode "
             "attention on the prefill kernel (no split-K), sampling filters row by row; slower "
             "(`python -m benchmarks.gpu_bench invariant` in a clone measures the cost); not with "
             "--tensor-parallel-size > 1")
    tensor_parallel_size: int = option(1, parse=positive_int,
                                       help="split the model over this many devices, one worker process each "
                                            "(torch.distributed: NCCL on CUDA, gloo on the CPU); 1 = one process. "
                                            "KV budgets are per device")
    speculative_config: SpeculativeConfig | None = option(
        None, parse=argparse_type(SpeculativeConfig.parse),
        help='several tokens per forward, the same output: JSON with vLLM\'s keys, e.g. \'{"method": "ngram", '
             '"num_speculative_tokens": 4}\' (prompt lookup: drafts what followed the last earlier occurrence of '
             'the latest prompt_lookup_max..prompt_lookup_min tokens; default 4..2), or \'{"method": "mtp", '
             '"model": DIR, "num_speculative_tokens": 4}\' (a Gemma 4 MTP drafter directory)')
    lora_modules: dict[str, str] | None = option(
        None, nargs=True, parse=str,
        help="LoRA adapters to serve, NAME=PATH (PEFT directories: adapter_config.json and "
             "adapter_model.safetensors); a request names one as its model (HTTP) or lora= (Python)")
    max_loras: int = option(4, parse=positive_int, help="most LoRA adapters in one step (device slots)")
    max_lora_rank: int = option(64, parse=positive_int, help="largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = option(None, parse=positive_int,
                                       help="adapters kept read in host memory, least recently used dropped "
                                            "(read again from disk when needed); default: max(--max-loras, the "
                                            "number of --lora-modules)")
    # Set by `serve --role prefill|decode` (no engine flag): config/kv_transfer.py.
    kv_transfer: "KVTransferConfig | None" = None
    # Set by `serve` (no flag): a long-lived engine.
    serving: bool = False
    # Benchmark only, no flag: pin V2's pool split at this sliding share (emulates per-life-cycle pools).
    kv_pool_split: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise UserInputError("model must be a non-empty string")
        self.hub_options()   # checks them
        if isinstance(self.dtype, str) and self.dtype in _REFUSED_DTYPES:
            raise UserInputError(_REFUSED_DTYPES[self.dtype])
        if self.dtype not in DTYPE_CHOICES:
            raise UserInputError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserInputError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise UserInputError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise UserInputError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if self.kv_offload_memory is not None:
            if not isinstance(self.kv_offload_memory, int) or isinstance(self.kv_offload_memory, bool) \
                    or self.kv_offload_memory < 1:
                raise UserInputError(
                    f"kv_offload_memory must be a positive number of bytes, got {self.kv_offload_memory!r}")
            free = available_host_memory()
            if free is not None and self.kv_offload_memory > free:
                raise UserInputError(f"--kv-offload-memory {format_bytes(self.kv_offload_memory)} exceeds the host's "
                                     f"available memory ({format_bytes(free)})")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise UserInputError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_manager not in KV_MANAGERS:
            raise UserInputError(f"kv_cache_manager must be one of {', '.join(KV_MANAGERS)}")
        if self.swa_scratch_reuse not in SCRATCH_CHOICES:
            raise UserInputError(f"swa_scratch_reuse must be one of {', '.join(SCRATCH_CHOICES)}")
        if self.async_scheduling not in SCRATCH_CHOICES:
            raise UserInputError(f"async_scheduling must be one of {', '.join(SCRATCH_CHOICES)}")
        if self.cpu_compile not in SCRATCH_CHOICES:
            raise UserInputError(f"cpu_compile must be one of {', '.join(SCRATCH_CHOICES)}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise UserInputError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                                 f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_DTYPE_CHOICES:
            raise UserInputError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, "
                                 f"got {self.kv_cache_dtype!r}")
        if self.enable_prefix_caching not in (None, True, False):
            raise UserInputError(f"enable_prefix_caching must be True, False or None, got {self.enable_prefix_caching!r}")
        if self.suppress_media_tokens not in (None, True, False):
            raise UserInputError(f"suppress_media_tokens must be True, False or None, got {self.suppress_media_tokens!r}")
        if self.kv_pool_split is not None and not (isinstance(self.kv_pool_split, float)
                                                   and 0.0 < self.kv_pool_split < 1.0):
            raise UserInputError(f"kv_pool_split must be a float in (0, 1), got {self.kv_pool_split!r}")
        if self.kv_pool_split is not None and self.enable_prefix_caching is not False:
            raise UserInputError("kv_pool_split (a benchmark knob) needs enable_prefix_caching=False")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise UserInputError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if tp > 1 and self.kv_cache_dtype.startswith("fp8"):
            raise UserInputError("kv_cache_dtype fp8 is not supported with tensor_parallel_size > 1 yet (its "
                                 "calibration pass runs on one process)")
        if not isinstance(self.batch_invariant, bool):
            raise UserInputError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if tp > 1 and self.batch_invariant:
            raise UserInputError("batch_invariant is not supported with tensor_parallel_size > 1 (the all-reduce "
                                 "picks its algorithm, hence its summation order, by message size: by the batch)")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.lora_modules = _lora_modules(self.lora_modules)
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserInputError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < 1):
            raise UserInputError(f"max_cpu_loras must be a positive integer, got {self.max_cpu_loras!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise UserInputError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}")

    def hub_options(self) -> HubOptions:
        return HubOptions(self.revision, self.gguf_file, self.hf_token, self.download_dir)

    def recorded(self) -> dict:
        """The options as a benchmark's JSON records them: a Hub token is never written down."""
        return {**vars(self), "hf_token": "<set>" if self.hf_token else None}

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    # -- resolution of "auto" values ---------------------------------------------------------
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise UserInputError(f"invalid device {self.device!r} (expected cpu, cuda or cuda:N)") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UserInputError(f"device {self.device!r} requested but CUDA is not available")
        if dev.type not in ("cpu", "cuda"):
            raise UserInputError(f"device type {dev.type!r} is not supported (cpu or cuda)")
        return dev

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, _DTYPES[self.dtype])

    def quantized_weights(self, device: torch.device) -> bool:
        """`--dtype auto` on the CPU keeps a GGUF file's quantised weights quantised (fp32 activations)."""
        return self.dtype == "auto" and device.type == "cpu"

    def cpu_compile_mode(self, device: torch.device, quantized: bool) -> str:
        """"off", "background" (auto with quantised weights: compiled steps from the cache, else built by a
        background process while the engine steps eagerly) or "now" (on: compiled before the first step)."""
        if device.type != "cpu" or self.enforce_eager or self.tensor_parallel_size > 1 or self.cpu_compile == "off":
            return "off"
        if self.cpu_compile == "on":
            return "now"
        return "background" if quantized else "off"

    def steady_state(self) -> "EngineConfig":
        """This configuration with what auto builds in the background (compiled CPU decode steps) built
        before the first step instead: what a benchmark of a long-running engine measures."""
        device = self.torch_device()
        if self.cpu_compile == "auto" and self.cpu_compile_mode(device, self.quantized_weights(device)) == "background":
            return self.replace(cpu_compile="on")
        return self

    def torch_kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's storage dtype for a model running in `model_dtype`."""
        import torch

        return model_dtype if self.kv_cache_dtype == "auto" else getattr(torch, _KV_DTYPES[self.kv_cache_dtype])

    def kv_budget_bytes(self, device: torch.device) -> int:
        """The KV cache budget. Call after the weights are on the device (they count as used)."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if device.type == "cuda":
            import torch

            # Blocks PyTorch's allocator keeps cached (an engine dropped in this process: its KV cache) are free
            # for this one, but the driver counts them as used until they are handed back.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * self.gpu_memory_utilization) - (total - free) - _GPU_ACTIVATION_RESERVE
            if budget <= 0:
                raise UserInputError(
                    f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB "
                    f"at --gpu-memory-utilization {self.gpu_memory_utilization}")
            return budget
        return _CPU_KV_DEFAULT
