"""A W4A16 checkpoint at real size, loaded and served with the default memory budget (issue 45, "Memory")
(`python -m benchmarks.gpu_quant_memory [shape] [--dir PATH] [--keep]`; default shape gemma4-31b).

There is no model hub here, so the run makes its own checkpoint: random weights at the shape's real size, quantised
as Google's `*-qat-w4a16-ct` releases are (compressed-tensors pack-quantized, int4 groups of 32, symmetric, bf16
scales; the head and the embeddings left unquantised, and in the `ignore` list, as are vision / audio towers), with
a tokenizer the loader reads. It is the text model alone (Gemma4ForCausalLM, tensors named as transformers names
them): Google's releases are Gemma4ForConditionalGeneration, the same text tensors under `model.language_model.`
plus a bf16 vision tower (audio too for E2B/E4B/12B) that the engine also loads, so a real release leaves the KV
cache that tower's bytes less. Phases (the JSON is rewritten after each):

  write   the checkpoint (`write_w4a16_checkpoint`): shard by shard (a few GB each, with
          model.safetensors.index.json), the tensors drawn on the GPU where there is one; seconds and bytes
  load    `LLM(dir, device=..., quantization="auto")` with the default --gpu-memory-utilization: wall seconds
          from the call to a ready engine (and the loader's own load and warm-up figures), the weight bytes on
          the device (packed int4 words, scales, everything else in bf16), the KV cache the engine allocated (bytes,
          pages, how many tokens one sequence could hold, how many 32K-token sequences fit), the allocator's and
          the driver's view of the device (allocated, reserved, free, total). The target: KV >= 40 GiB on an
          80 GB card (--kv-target-gib; checked on CUDA only)
  serve   4 prompts (text, through LLM.generate), 64 greedy tokens each; one long prompt (32K tokens by default)
          with a few new tokens (the KV it needs is usable); batch-1 decode tokens/s

Writes $OUT/gpu_quant_memory.json (OUT defaults to "."); a table last; exit status 1 if a phase raised or the
KV target was missed. The checkpoint directory (default: a fresh one under /tmp) is deleted at the end unless
--keep. `--device cpu` runs the same phases on the CPU (a tiny config: the tests do).

The writer uses torch, safetensors and our own code only (compressed-tensors is not installed on the GPU
machines); tests/test_quant_memory_bench.py checks it against compressed-tensors' own unpacking.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

GiB = 1 << 30
GROUP = 32
# What a W4A16 release leaves unquantised, in the checkpoint's own module names: the output head, every embedding
# table, the media towers and their projections into the text model, the E models' per-layer-input Linears, and
# MoE routers. The rest of the Linear layers (the attention and MLP projections) are int4.
IGNORE = ("lm_head", "re:.*embed_tokens.*", "re:.*vision_tower.*", "re:.*embed_vision.*", "re:.*audio_tower.*",
          "re:.*embed_audio.*", "re:.*per_layer.*", "re:.*router.*")


def quantization_config(group: int = GROUP, ignore: tuple[str, ...] = IGNORE) -> dict:
    """config.json's `quantization_config` of a compressed-tensors W4A16 checkpoint: one config group, int4 weights
    in symmetric groups of `group` over every Linear, activations unquantised, format pack-quantized."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": group, "strategy": "group",
               "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
            "global_compression_ratio": None}


# -- the checkpoint's tensors -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the checkpoint: its name, shape and dtype, and how it is drawn ("int4" packed words,
    "scale" int4 group scales, "shape" a weight_shape, "gain" a norm-like gain near its identity, "matrix")."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    weight: tuple[int, int] | None = None   # "scale", "shape": the module's weight shape (N, K)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def raw_config(shape: str | dict, layers: int | None = None) -> dict:
    """A Gemma 4 shape's Hugging Face config.json: a name of synthetic.GEMMA4_CONFIGS, a path to a config.json, or a
    dict; with the token ids our tokenizer has and the dtype a bf16 release declares. `layers`: only the first that
    many (the same layer shapes and pattern, a smaller checkpoint)."""
    from gemmaserve.testing.synthetic import GEMMA4_CONFIGS

    if isinstance(shape, str):
        if shape in GEMMA4_CONFIGS:
            shape = GEMMA4_CONFIGS[shape]
        elif shape.endswith(".json") and Path(shape).is_file():
            shape = json.loads(Path(shape).read_text())
        else:
            raise KeyError(f"unknown Gemma 4 shape {shape!r}; known: {', '.join(GEMMA4_CONFIGS)}, or a config.json")
    raw = {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "bfloat16",
           "tie_word_embeddings": True, **shape}
    raw.pop("quantization_config", None)
    if layers is not None:
        raw["num_hidden_layers"] = layers
        if "layer_types" in raw:
            raw["layer_types"] = raw["layer_types"][:layers]
    return raw


def _meta_model(raw: dict):
    from gemmaserve.models.registry import model_class_for_hf

    cls = model_class_for_hf(raw.get("architectures"), raw.get("model_type"))
    with torch.device("meta"):
        return cls(cls.config_class.from_hf(raw), torch.bfloat16)


def plan_tensors(raw: dict, group: int = GROUP) -> list[TensorPlan]:
    """Every tensor of the checkpoint in the model's order, in the checkpoint's names: for each attention and MLP
    projection (fused q/k/v and gate/up split into their parts) `weight_packed` int32 [N, K / 8], `weight_scale`
    bf16 [N, K / group] and `weight_shape` int64 [2]; every other parameter of the model in bf16. Taken from our
    model of the config (built on the meta device), each name checked to map back onto it."""
    from gemmaserve.models.layers import Linear
    from gemmaserve.models.quantized import our_module, projection_names
    from gemmaserve.quantization.compressed_tensors import QuantPlan

    model = _meta_model(raw)
    projections = set(projection_names(model))
    parts_of: dict[str, list[str]] = {}
    for part, (fused, idx) in sorted(model.stacked.items(), key=lambda kv: kv[1][1]):
        parts_of.setdefault(fused, []).append(part)
    modules = dict(model.named_modules())
    plan = QuantPlan.from_hf(quantization_config(group), "config.json")
    out: list[TensorPlan] = []
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if module not in projections:
            if model.checkpoint_name(name) != name:
                raise ValueError(f"{name}: the checkpoint names it otherwise")
            gain = "norm" in name or name.endswith(("scale", "layer_scalar"))   # as synthetic.random_model
            out.append(TensorPlan(name, tuple(p.shape), torch.bfloat16, "gain" if gain else "matrix"))
            continue
        assert leaf == "weight", name
        prefix, _, own = module.rpartition(".")
        sizes = model.shard_sizes(name) if own in parts_of else (p.shape[0],)
        k = p.shape[1]
        if k % group or k % 8:
            raise ValueError(f"{module}: input width {k} is not a multiple of the group {group}")
        for part, n in zip(parts_of.get(own, [own]), sizes):
            ckpt = f"{prefix}.{part}"
            if (ours := model.checkpoint_name(f"{ckpt}.weight")) is None or our_module(model, ours)[0] != module:
                raise ValueError(f"{ckpt}: does not map onto {module}")
            if plan.for_module(ckpt, True) is None:
                raise ValueError(f"{ckpt}: the quantization_config leaves it unquantised")
            out += [TensorPlan(f"{ckpt}.weight_packed", (n, k // 8), torch.int32, "int4"),
                    TensorPlan(f"{ckpt}.weight_scale", (n, k // group), torch.bfloat16, "scale", (n, k)),
                    TensorPlan(f"{ckpt}.weight_shape", (2,), torch.int64, "shape", (n, k))]
    # Every other Linear of the model is left as saved by the ignore list (else the loader would want its int4).
    for name, m in modules.items():
        if isinstance(m, Linear) and name not in projections and plan.for_module(name, True) is not None:
            raise ValueError(f"{name}: a Linear the quantization_config quantises but the checkpoint keeps in bf16")
    return out


def _draw(t: TensorPlan, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A tensor of plan `t` on `device`, random but for weight_shape. int4 words: every nibble uniform in 0..15
    (values -8..7, stored + 8; std 4.6); scales uniform in K^-1/2 / 4.6 * [0.75, 1.25], so that the weights have
    about the spread synthetic.random_model draws (std K^-1/2); gains near 1 (Gemma 4's norms scale by w)."""
    if t.kind == "shape":
        return torch.tensor(t.weight, dtype=torch.int64, device=device)
    if t.kind == "int4":
        n, words = t.shape
        raw = torch.randint(0, 256, (n, words * 4), generator=gen, device=device, dtype=torch.uint8)
        return raw.view(torch.int32)
    x = torch.empty(t.shape, dtype=torch.float32, device=device)
    if t.kind == "scale":
        x.uniform_(0.75, 1.25, generator=gen).mul_(t.weight[1] ** -0.5 / 4.61)
    elif t.kind == "gain":
        x.normal_(1.0, 0.1, generator=gen)
    else:
        x.normal_(0.0, t.shape[-1] ** -0.5, generator=gen)
    return x.to(t.dtype)


def shards(plan: list[TensorPlan], shard_bytes: int) -> list[list[TensorPlan]]:
    """The tensors in order, cut into shards of at most `shard_bytes` (a larger tensor alone in its own)."""
    out: list[list[TensorPlan]] = [[]]
    size = 0
    for t in plan:
        if out[-1] and size + t.nbytes > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.nbytes
    return out


@dataclass
class Written:
    path: Path
    seconds: float = 0.0
    files: int = 0
    tensors: int = 0
    bytes_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_kind.values())

    def summary(self) -> dict:
        b = self.bytes_by_kind
        return {"dir": str(self.path), "write_s": round(self.seconds, 1),
                "write_GB_s": round(self.total_bytes / 1e9 / max(self.seconds, 1e-9), 2), "files": self.files,
                "tensors": self.tensors,
                "total_GB": round(self.total_bytes / 1e9, 3), "packed_GB": round(b.get("int4", 0) / 1e9, 3),
                "scales_GB": round(b.get("scale", 0) / 1e9, 3),
                "bf16_rest_GB": round((b.get("gain", 0) + b.get("matrix", 0)) / 1e9, 3), "bytes_by_kind": dict(b)}


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """synthetic.py's tokenizer (token i is "w<i>"; 0-2 pad, eos, bos) as tokenizer.json, words split on
    whitespace, so that text prompts of "w<i>" words encode; tokenizer_config.json names the specials."""
    from tokenizers import pre_tokenizers

    from gemmaserve.testing.synthetic import synthetic_tokenizer

    backend = synthetic_tokenizer(vocab_size).backend
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "add_bos_token": True}))


def write_w4a16_checkpoint(path: str | Path, shape: str | dict = "gemma4-31b", *, layers: int | None = None,
                           group: int = GROUP, shard_bytes: int = 4 * 10**9, seed: int = 0,
                           device: str | torch.device | None = None, log=None) -> Written:
    """A compressed-tensors W4A16 checkpoint of random weights at `shape` (raw_config: a Gemma 4 shape name, a
    config.json, or an HF config dict; `layers`: only the first that many) in directory `path` (created; must be
    empty or absent): config.json with its quantization_config, safetensors shards of at most `shard_bytes` (with
    model.safetensors.index.json where there are several), a tokenizer. Tensors are drawn on `device` (default:
    CUDA where there is one) one shard at a time, so the host holds one shard at most."""
    start = time.perf_counter()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty")
    from safetensors.torch import save_file

    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    raw = raw_config(shape, layers)
    plan = plan_tensors(raw, group)
    cut = shards(plan, shard_bytes)
    gen = torch.Generator(device=dev).manual_seed(seed)
    written = Written(path)
    weight_map: dict[str, str] = {}
    for i, part in enumerate(cut):
        file = f"model-{i + 1:05d}-of-{len(cut):05d}.safetensors" if len(cut) > 1 else "model.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for t in part:
            tensors[t.name] = _draw(t, gen, dev).cpu()
            weight_map[t.name] = file
            written.bytes_by_kind[t.kind] = written.bytes_by_kind.get(t.kind, 0) + t.nbytes
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        written.files += 1
        written.tensors += len(tensors)
        del tensors
        if log is not None:
            log(f"wrote {file} ({sum(t.nbytes for t in part) / 1e9:.2f} GB, {time.perf_counter() - start:.0f} s)")
    if len(cut) > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": written.total_bytes}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization_config(group)},
                                                 indent=2))
    write_tokenizer(path, raw.get("vocab_size", 262144))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    written.seconds = time.perf_counter() - start
    return written


# -- measuring ----------------------------------------------------------------------------------------------------
def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the model's weights on its device: "packed" (int4 words), "scales" (their group scales, zero points,
    offsets), "fp8" (fp8 weights and scales), "dense" (every other parameter and buffer, bf16 or fp32). Each
    storage counted once (a tied head is the embedding)."""
    from gemmaserve.quantization.int4_kernels import Int4Packed
    from gemmaserve.quantization.linear import QuantizedLinear
    from gemmaserve.quantization.schemes import Fp8Weight, Int4Weight

    seen: set[int] = set()
    out = {"packed": 0, "scales": 0, "fp8": 0, "dense": 0}

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is None or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        out[kind] += storage.nbytes()

    for m in model.modules():
        w = getattr(m, "kernel_weight", None) if isinstance(m, QuantizedLinear) else None
        if isinstance(w, Int4Packed):
            add("packed", w.qweight)
            for t in (w.scale, w.zero, w.offset):
                add("scales", t)
        elif isinstance(w, Int4Weight):   # the CPU reference's layout: one value per byte
            add("packed", w.q)
            for t in (w.scale, w.zero, w.offset):
                add("scales", t)
        elif isinstance(w, Fp8Weight):
            add("fp8", w.q)
            add("fp8", w.scale)
        own = [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        packed = any(name == "qweight" for name, _ in own)   # the CPU's INT4 / INT8 modules (models/quant.py)
        for name, t in own:
            add(("packed" if name == "qweight" else "scales") if packed else "dense", t)
    out["total"] = sum(out.values())
    return out


def kv_figures(parts, long_tokens: int) -> dict:
    """The KV cache the engine allocated: bytes (the manager's pages, and the device tensors themselves), pages,
    the most tokens one sequence can hold, and how many sequences of `long_tokens` fit at once."""
    kv = parts.kv
    storages = {}
    for k, v in parts.runner.kv_cache:
        for t in (k, v):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    lo, hi = 0, 1
    while kv.pages_at(hi) <= kv.num_pages and hi < 1 << 26:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kv.pages_at(mid) <= kv.num_pages else (lo, mid)
    specs = kv.specs
    every_layer = sum(s.bytes_per_token() for s in specs)
    return {"kv_bytes": kv.num_pages * kv.page_bytes, "kv_tensor_bytes": sum(storages.values()),
            "kv_pages": kv.num_pages, "page_bytes": kv.page_bytes, "kv_manager": kv.name,
            "max_tokens_one_sequence": lo,
            "tokens_if_every_layer_kept_every_token": (kv.num_pages * kv.page_bytes) // every_layer,
            "kv_bytes_per_token_every_layer": every_layer,
            f"sequences_of_{long_tokens}": kv.num_pages // max(1, kv.pages_at(long_tokens))}


def _device_memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated_GB": round(torch.cuda.memory_allocated(device) / 1e9, 3),
            "reserved_GB": round(torch.cuda.memory_reserved(device) / 1e9, 3),
            "max_allocated_GB": round(torch.cuda.max_memory_allocated(device) / 1e9, 3),
            "free_GB": round(free / 1e9, 3), "total_GB": round(total / 1e9, 3)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _words(rng: random.Random, n: int, vocab: int) -> str:
    return " ".join(f"w{rng.randrange(3, vocab)}" for _ in range(n))


def serve(llm, res: dict, device: torch.device, long_tokens: int, new_tokens: int, decode_steps: int,
          decode_context: int = 1024, save=lambda: None) -> None:
    """The serving phase (see the module docstring): fills res["serve"], calling `save` after each part."""
    from gemmaserve.engine.sampling_params import SamplingParams

    eng = llm.engine
    vocab = eng.info.vocab_size
    out = res["serve"] = {}
    rng = random.Random(45)
    prompts = [_words(rng, n, vocab) for n in (17, 40, 75, 120)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    _sync(device)
    t = time.perf_counter()
    got = llm.generate(prompts, params)
    _sync(device)
    secs = time.perf_counter() - t
    lens = [len(o.outputs[0].token_ids) for o in got]
    if lens != [new_tokens] * len(prompts):
        raise AssertionError(f"generated {lens} tokens, expected {new_tokens} each")
    again = llm.generate(prompts[:1], params)   # greedy: the same tokens again (prefix cache hit or not)
    out["prompts"] = {"count": len(prompts), "new_tokens": new_tokens, "seconds": round(secs, 2),
                      "tok_s": round(sum(lens) / secs, 1), "repeat_equal": again[0].outputs[0].token_ids ==
                      got[0].outputs[0].token_ids, "text_0": got[0].outputs[0].text[:80]}
    print("serve prompts", out["prompts"], flush=True)
    save()

    # One long prompt: its KV (every full-attention layer holds every token) must be there to use.
    ids = [2] + [rng.randrange(3, vocab) for _ in range(long_tokens - 1)]
    _sync(device)
    t = time.perf_counter()
    rid = eng.add_request("", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), prompt_ids=ids)
    first = None
    peak = 0
    tokens = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == rid and first is None and o.outputs and o.outputs[0].delta_token_ids:
                _sync(device)
                first = time.perf_counter() - t
            if o.request_id == rid and o.finished:
                tokens = list(o.outputs[0].token_ids)
        peak = max(peak, eng.snapshot().pages_used)
    _sync(device)
    out["long"] = {"prompt_tokens": long_tokens, "new_tokens": len(tokens), "ttft_s": round(first or 0.0, 2),
                   "seconds": round(time.perf_counter() - t, 2),
                   "prefill_tok_s": round(long_tokens / first) if first else None, "peak_pages_used": peak,
                   "peak_kv_GB": round(peak * eng.internals().kv.page_bytes / 1e9, 3)}
    print("serve long", out["long"], flush=True)
    if len(tokens) != 8:
        raise AssertionError(f"the long prompt gave {len(tokens)} tokens, expected 8")
    save()

    # Batch-1 decode: one sequence (a `decode_context`-token prompt) stepping alone, timed over `decode_steps` steps.
    ids = [2] + [rng.randrange(3, vocab) for _ in range(decode_context - 1)]
    rid = eng.add_request("", SamplingParams(max_tokens=decode_steps + 40, temperature=0.0, ignore_eos=True),
                          prompt_ids=ids)
    parts = eng.internals()
    while parts.scheduler.waiting or not all(r.prompt_computed for r in parts.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(decode_steps):
        eng.step()
    _sync(device)
    step_s = (time.perf_counter() - t) / decode_steps
    eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    out["decode_batch1"] = {"context": decode_context, "steps": decode_steps, "step_ms": round(step_s * 1e3, 3),
                            "tok_s": round(1 / step_s, 1)}
    print("serve decode", out["decode_batch1"], flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", nargs="?", default="gemma4-31b",
                    help="a Gemma 4 shape (testing/synthetic.py), or a config.json")
    ap.add_argument("--layers", type=int, default=None, help="only the first N layers (a quick run)")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint, an empty or absent directory "
                                                "(default: a new one in /tmp); removed at the end unless --keep")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--long", type=int, default=32768, help="tokens of the long prompt")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=100)
    ap.add_argument("--decode-context", type=int, default=1024, help="prompt tokens before the timed decode steps")
    ap.add_argument("--kv-target-gib", type=float, default=40.0)
    ap.add_argument("--engine", default="{}", help="more engine options, as JSON (e.g. '{\"max_model_len\": 65536}')")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"benchmark": "gpu_quant_memory", "shape": args.shape, "layers": args.layers,
                 "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}

    def save() -> None:   # after every phase: a command stopped at its time limit keeps what finished
        (out / "gpu_quant_memory.json").write_text(json.dumps(res, indent=2, default=str))

    if device.type == "cuda":
        res["card_total_GiB"] = round(torch.cuda.get_device_properties(device).total_memory / GiB, 2)
    ckpt = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gemmaserve-w4a16-", dir="/tmp"))
    if ckpt.exists() and (not ckpt.is_dir() or any(ckpt.iterdir())):   # never removed: it is not ours
        print(f"--dir {ckpt}: not an empty directory", file=sys.stderr)
        return 2
    failed = False
    llm = None
    try:
        try:
            written = write_w4a16_checkpoint(ckpt, args.shape, layers=args.layers,
                                             device=device if device.type == "cuda" else "cpu",
                                             log=lambda s: print(s, flush=True))
            res["write"] = written.summary()
            print("write", res["write"], flush=True)
        except Exception as exc:
            traceback.print_exc()
            res["write_error"] = repr(exc)
            return 1
        finally:
            save()

        try:
            from gemmaserve.engine.llm import LLM

            res["before_load"] = _device_memory(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                free, total = torch.cuda.mem_get_info(device)
                used_before = total - free   # this process's CUDA context, and anything else on the card
            opts = json.loads(args.engine)
            t = time.perf_counter()
            llm = LLM(str(ckpt), device=args.device, quantization="auto", **opts)
            wall = time.perf_counter() - t
            info = llm.engine.info
            parts = llm.engine.internals()
            weights = weight_bytes(parts.model)
            res["load"] = {"wall_s": round(wall, 1), "loader_s": round(info.load_seconds, 1),
                           "warmup_s": round(info.warmup_seconds, 1), "weights": info.weights,
                           "dtype": info.dtype, "gpu_memory_utilization": llm.engine.config.gpu_memory_utilization,
                           "max_model_len": info.max_model_len, "cuda_graphs": info.cuda_graphs,
                           **{f"weight_{k}_GB": round(v / 1e9, 3) for k, v in weights.items()},
                           "weight_bytes": weights,
                           **kv_figures(parts, args.long), **_device_memory(device)}
            load = res["load"]
            load["kv_GiB"] = round(load["kv_bytes"] / GiB, 2)
            if device.type == "cuda":
                load["kv_target_GiB"] = args.kv_target_gib
                load["kv_target_met"] = load["kv_bytes"] >= args.kv_target_gib * GiB
                if llm.engine.config.kv_cache_memory is None:
                    # The engine sized its KV cache as util * total - used - reserve (EngineConfig.kv_budget_bytes,
                    # within a page): what the device held then beyond the context and the weights is what the load
                    # left behind (allocator blocks it could not hand back, buffers), taken from the KV cache.
                    from gemmaserve.config.engine import _GPU_ACTIVATION_RESERVE

                    util = llm.engine.config.gpu_memory_utilization
                    used = int(total * util) - _GPU_ACTIVATION_RESERVE - load["kv_bytes"]
                    load["used_at_kv_sizing_GB"] = round(used / 1e9, 3)
                    load["load_overhead_GB"] = round((used - used_before - weights["total"]) / 1e9, 3)
            print("load", load, flush=True)
            if "w4a16" not in info.weights:
                raise AssertionError(f"the checkpoint loaded as {info.weights!r}, not W4A16")
        except Exception as exc:
            traceback.print_exc()
            res["load_error"] = repr(exc)
            return 1
        finally:
            save()

        try:
            serve(llm, res, device, args.long, args.new_tokens, args.decode_steps, args.decode_context, save)
            res["after_serve"] = _device_memory(device)
        except Exception as exc:
            traceback.print_exc()
            res["serve_error"] = repr(exc)
            failed = True
        finally:
            save()
    finally:
        if llm is not None:
            llm.close()
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
        _table(res)
        save()
    missed = res.get("load", {}).get("kv_target_met") is False
    if missed:
        print(f"FAIL: KV cache {res['load']['kv_GiB']} GiB < {args.kv_target_gib} GiB", flush=True)
    return 1 if failed or missed or any(k.endswith("_error") for k in res) else 0


def _table(res: dict) -> None:
    w, ld, sv = res.get("write", {}), res.get("load", {}), res.get("serve", {})
    rows = [("shape", res.get("shape")), ("device", f"{res.get('device')} ({res.get('card_total_GiB', '-')} GiB)"),
            ("checkpoint GB", w.get("total_GB")), ("write s (GB/s)", f"{w.get('write_s')} ({w.get('write_GB_s')})"),
            ("load wall s (loader, warm-up)", f"{ld.get('wall_s')} ({ld.get('loader_s')}, {ld.get('warmup_s')})"),
            ("weights on device GB (packed, scales, dense)",
             f"{ld.get('weight_total_GB')} ({ld.get('weight_packed_GB')}, {ld.get('weight_scales_GB')}, "
             f"{ld.get('weight_dense_GB')})"),
            ("KV GiB (target)", f"{ld.get('kv_GiB')} ({ld.get('kv_target_GiB', '-')}: "
                                f"{'met' if ld.get('kv_target_met') else 'MISSED' if 'kv_target_met' in ld else '-'})"),
            ("KV tokens, one sequence", ld.get("max_tokens_one_sequence")),
            ("left by the load, beyond the weights GB", ld.get("load_overhead_GB")),
            ("allocated / reserved / free GB", f"{ld.get('allocated_GB')} / {ld.get('reserved_GB')} / "
                                               f"{ld.get('free_GB')}"),
            ("4 prompts tok/s", sv.get("prompts", {}).get("tok_s")),
            ("long prompt TTFT s", sv.get("long", {}).get("ttft_s")),
            ("batch-1 decode tok/s", sv.get("decode_batch1", {}).get("tok_s"))]
    for k, v in rows:
        print(f"{k:46} {v}")
    for k, v in res.items():
        if k.endswith("_error"):
            print(f"{k:46} {v[:200]}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
