"""Vision on the GPU (`python -m benchmarks.gpu_vision [sections] [--shapes a,b]`), issue 12 item 7:
random weights at the real sizes of one Gemma 3 vision checkpoint (gemma3-4b: SigLIP 896 px, 256 tokens per
image) and one Gemma 4 (gemma4-e4b: ViT, up to 280 tokens per image), bf16. Sections (default: all):

  check       tiny random Gemma 3 and Gemma 4 (E2B-like, 31B-like) vision checkpoints from tests/helpers.py,
              saved with save_pretrained and loaded by our loader on the device: fp32 last-position logits of
              1- and 2-image prompts against transformers (max |diff| < 1e-3, TF32 off), for the default
              attention backend and the torch one, and whether 4 greedy tokens equal HF `generate`'s
  ttft        time to first token of one request with 1, 4 and 8 images (encoder + prefill, max_tokens=1),
              encoder cache and prefix cache off so every run does the whole work: our engine fed the
              prepared ids and pixels ("ours"), and `LLM.generate` from PIL images (preprocessing included,
              "ours_e2e"), against HF `generate(max_new_tokens=1)` on the same weights, ids and pixels (host
              to device copy of the pixels included in both); median of `--runs` (5) after 2 warm-ups, and
              HF / ours
  media       Gemma 4 shapes with an audio tower: time to first token of one request with 1 and 4 audio clips
              of 30 s (750 tokens each) and one with a 16-frame video (70 tokens a frame), ours ("ours": prepared
              ids and features; "ours_e2e": `LLM.generate` from samples / an encoded MP4, preprocessing and
              decoding included) against HF `generate(max_new_tokens=1)` on the same weights, ids and features
  throughput  a mixed workload (32 requests: half with one image drawn from a pool of 4, so images repeat;
              half text only; ~128 text tokens each, 64 new tokens), encoder cache on (the default size) and
              off (`encoder_cache_memory=0`): tok/s, wall time, and encoder calls (the model's
              `encode_images` wrapped) and images encoded. Text comes before each image and differs per
              request, so the prefix cache never serves an image: repeats are the encoder cache's alone

The real shapes are built as transformers models (config classes with the hyper-parameters of
shared/reference/gemma-architecture.md §7), filled with random weights on the device, and mapped into ours by
the loader's `build_model` (the checkpoint names of save_pretrained); the tokenizer is a word-level one
("w<i>" is token i) with the image specials at their real ids, so prompts and images go through
`LLM.generate` as users pass them (Gemma 3's "\\n\\n" around an image tokenise to nothing: 2 tokens fewer per
image than with the real tokenizer).

`--device cpu --tiny` runs every section on tiny configs on the CPU in seconds (what CI tests). Writes
$OUT/gpu_vision.json after every section (a timeout keeps what finished); a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from gemmaserve.bench.sections import exit_status, run_sections
from gemmaserve.models.base import CausalLM
from gemmaserve.models.loader import LoadedModel, ModelSource, SourceKind, build_model
from gemmaserve.models.registry import model_class_for_hf
from gemmaserve.models.tokenizer import Tokenizer
from gemmaserve.testing.synthetic import GEMMA4_CONFIGS, gemma3_config

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers import PretrainedConfig

    from gemmaserve.engine.media.items import MediaItem
    from gemmaserve.engine.llm import LLM

GiB = 1 << 30
MiB = 1 << 20
LOGIT_TOL = 1e-3


# -- shapes -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VisionShape:
    """A multimodal checkpoint's shape: the transformers composite config's parts and its image specials."""

    family: str                              # "gemma3" or "gemma4"
    text: Mapping[str, Any]                  # text_config
    vision: Mapping[str, Any]                # vision_config
    specials: tuple[int, int, int]           # begin-of-image, end-of-image, image soft-token ids
    tokens_per_image: int                    # Gemma 3: mm_tokens_per_image; Gemma 4: the soft-token budget
    image_sizes: tuple[tuple[int, int], ...]   # (width, height) of the random images, cycled
    audio: Mapping[str, Any] | None = None   # Gemma 4 audio_config (E2B/E4B), None: no audio tower

    def __post_init__(self) -> None:   # read-only views: the shapes are module constants
        object.__setattr__(self, "text", MappingProxyType(dict(self.text)))
        object.__setattr__(self, "vision", MappingProxyType(dict(self.vision)))
        if self.audio is not None:
            object.__setattr__(self, "audio", MappingProxyType(dict(self.audio)))


SPECIAL_TEXTS = MappingProxyType({"gemma3": ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
                                  "gemma4": ("<|image>", "<image|>", "<|image|>")})
# Gemma 4's audio and video specials at their real ids (boa, eoa, audio token, video token)
GEMMA4_AV_SPECIALS = MappingProxyType({256000: "<|audio>", 258883: "<audio|>", 258881: "<|audio|>", 258884: "<|video|>"})
TINY_AV_SPECIALS = MappingProxyType({292: "<|audio>", 293: "<audio|>", 294: "<|audio|>", 295: "<|video|>"})
REAL_AUDIO = MappingProxyType({})   # transformers' Gemma4AudioConfig defaults are E2B/E4B's conformer
REAL_IMAGES = ((896, 896), (640, 480))
GEMMA4_VIT = MappingProxyType(dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16,
                                   num_attention_heads=12, num_key_value_heads=12, head_dim=64, patch_size=16,
                                   position_embedding_size=10240, pooling_kernel_size=3,
                                   use_clipped_linears=True))   # E2B and E4B


def _gemma4_text(name: str) -> dict[str, Any]:
    return {k: v for k, v in GEMMA4_CONFIGS[name].items() if k != "architectures"}


SHAPES = MappingProxyType({
    "gemma3-4b": VisionShape("gemma3", gemma3_config("gemma3-4b").to_hf_dict(),
                             dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                  num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False),
                             (255999, 256000, 262144), 256, REAL_IMAGES),
    "gemma4-e4b": VisionShape("gemma4", _gemma4_text("gemma4-e4b"), GEMMA4_VIT, (255999, 258882, 258880), 280,
                              REAL_IMAGES, REAL_AUDIO),
    "gemma4-e2b": VisionShape("gemma4", _gemma4_text("gemma4-e2b"), GEMMA4_VIT, (255999, 258882, 258880), 280,
                              REAL_IMAGES),
    # CPU-sized stand-ins with the same structure (SigLIP + pooling; ViT with clipped linears, PLE, KV sharing).
    "gemma3-tiny": VisionShape("gemma3", dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                              sliding_window=8, query_pre_attn_scalar=16, max_position_embeddings=4096,
                                              layer_types=["sliding_attention", "full_attention"] * 2),
                               dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=56, patch_size=7, vision_use_head=False),
                               (297, 298, 299), 16, ((64, 64), (48, 36))),
    "gemma4-tiny": VisionShape("gemma4", dict(model_type="gemma4_text", vocab_size=300, hidden_size=64,
                                              intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                                              num_key_value_heads=1, head_dim=16, global_head_dim=32,
                                              layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
                                              sliding_window=8, final_logit_softcapping=30.0,
                                              max_position_embeddings=4096, hidden_size_per_layer_input=8,
                                              vocab_size_per_layer_input=300, num_kv_shared_layers=2),
                               dict(GEMMA4_VIT, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=4,
                                    position_embedding_size=128),
                               (297, 298, 299), 70, ((48, 48), (40, 30)),
                               dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    subsampling_conv_channels=[128, 4], output_proj_dims=24)),
})
REAL_SHAPES = ("gemma3-4b", "gemma4-e4b")
TINY_SHAPES = ("gemma3-tiny", "gemma4-tiny")


@dataclass(frozen=True)
class Workload:
    """How much each section does: the real run's sizes, or the CPU test's."""

    image_counts: tuple[int, ...] = (1, 4, 8)
    runs: int = 5                   # timed TTFT runs per configuration (median), after `warmups`
    warmups: int = 2
    requests: int = 32
    prompt_tokens: int = 128
    new_tokens: int = 64
    pool: int = 4                   # distinct images the throughput requests draw from
    clip_counts: tuple[int, ...] = (1, 4)   # media: 30 s audio clips per request
    clip_seconds: float = 30.0
    video_frames: int = 16
    kv_cache_memory: int = 8 * GiB
    ttft_batched_tokens: int = 8192     # the whole 8-image prompt in one step, as HF prefills it
    batched_tokens: int = 2048          # throughput: the engine's default, so prefill spans steps


TINY_WORKLOAD = Workload(image_counts=(1, 4, 8), runs=1, warmups=1, requests=8, prompt_tokens=24, new_tokens=4,
                         pool=2, kv_cache_memory=64 * MiB, ttft_batched_tokens=1024, batched_tokens=128,
                         clip_counts=(1, 2), clip_seconds=2.0, video_frames=4)


# -- models ---------------------------------------------------------------------------------------------
def hf_config(shape: VisionShape, attn_implementation: str = "sdpa") -> PretrainedConfig:
    import transformers

    boi, eoi, image = shape.specials
    common = dict(image_token_id=image, boi_token_id=boi, eoi_token_id=eoi)
    text = {**shape.text, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    if shape.family == "gemma3":
        cfg = transformers.Gemma3Config(text_config=text, vision_config=dict(shape.vision),
                                        mm_tokens_per_image=shape.tokens_per_image, **common)
        cfg.architectures = ["Gemma3ForConditionalGeneration"]
    else:
        tiny = shape.text["vocab_size"] < 1000
        boa, eoa, audio, video = TINY_AV_SPECIALS if tiny else GEMMA4_AV_SPECIALS
        cfg = transformers.Gemma4Config(text_config=text, vision_config=dict(shape.vision),
                                        audio_config=None if shape.audio is None else dict(shape.audio),
                                        boa_token_id=boa, eoa_token_index=eoa, audio_token_id=audio,
                                        video_token_id=video, **common)
        cfg.vision_soft_tokens_per_image = shape.tokens_per_image
        cfg.architectures = ["Gemma4ForConditionalGeneration"]
    cfg._attn_implementation = attn_implementation
    if getattr(cfg, "audio_config", None) is not None:   # transformers' conformer has only its eager attention
        cfg.audio_config._attn_implementation = "eager"
    return cfg


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build in `dtype` as from_pretrained(dtype=...) does (buffers made from the default dtype follow it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@torch.inference_mode()
def _randomize(hf: nn.Module, family: str, seed: int) -> None:
    """Random parameters, norms near their identity (Gemma 3's RMSNorms are 1 + w, Gemma 4's w, LayerNorms
    w and b) so activations stay in range in bf16. Buffers keep what the constructor made (clip bounds
    +-inf, layer scalars, RoPE tables): values do not change the speed."""
    device = next(hf.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    layer_norms = {id(m.weight) for m in hf.modules() if isinstance(m, nn.LayerNorm)}
    rms_identity = 0.0 if family == "gemma3" else 1.0
    for name, p in hf.named_parameters():
        if id(p) in layer_norms:
            p.normal_(1.0, 0.1, generator=gen)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.02, generator=gen)
        elif "norm" in name:
            p.normal_(rms_identity, 0.1, generator=gen)
        else:
            fan_in = p[0].numel() if p.dim() == 4 else p.shape[-1]   # a conv's fan-in is its whole kernel
            p.normal_(0.0, fan_in ** -0.5, generator=gen)


def vision_tokenizer(vocab_size: int, specials: Mapping[int, str]) -> Tokenizer:
    """Word-level: "w<i>" is token i, split on whitespace; the image specials are added tokens at their ids
    (ids 0-2: pad, eos, bos; prompts write "<bos>" themselves)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    named = {0: "<pad>", 1: "<eos>", 2: "<bos>", **specials}
    vocab = {named.get(i, f"w{i}"): i for i in range(vocab_size)}
    for i, text in specials.items():
        vocab.setdefault(text, i)   # an id beyond the vocabulary (none of ours; kept general)
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(named.values()))
    return Tokenizer.from_backend(backend, bos=2, eos=1)


def hf_model(cfg: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Transformers' model for `cfg` on `device` in `dtype`, weights not initialised (`_randomize` fills them)."""
    import transformers

    from gemmaserve.testing.hf_reference import _no_init

    with _default_dtype(dtype), torch.device(device), _no_init():
        hf = getattr(transformers, cfg.architectures[0])(cfg)
    return hf.requires_grad_(False).eval()


def ours_from_hf(hf: nn.Module, cfg: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Our model class for `cfg` (the registry's pick), filled with `hf`'s tensors by the loader's
    `build_model` under their checkpoint names (what save_pretrained would write)."""
    cls = model_class_for_hf(cfg.architectures, cfg.model_type)
    config = cls.config_class.from_hf(cfg.to_dict())
    return build_model(cls, config, lambda m, plan: m.map_checkpoint(hf.state_dict().items()), dtype, device).eval()


def build_models(name: str, dtype: torch.dtype, device: torch.device, keep_hf: bool = True,
                 seed: int = 0) -> tuple[nn.Module | None, LoadedModel]:
    """Transformers' model of shape `name` with random weights, and ours holding the same weights; the HF
    model is dropped unless `keep_hf`."""
    start = time.perf_counter()
    shape = SHAPES[name]
    cfg = hf_config(shape)
    hf = hf_model(cfg, dtype, device)
    _randomize(hf, shape.family, seed)
    model = ours_from_hf(hf, cfg, dtype, device)
    specials = dict(zip(shape.specials, SPECIAL_TEXTS[shape.family]))
    if shape.family == "gemma4":
        specials.update(TINY_AV_SPECIALS if shape.text["vocab_size"] < 1000 else GEMMA4_AV_SPECIALS)
    tokenizer = vision_tokenizer(shape.text["vocab_size"], specials)
    loaded = LoadedModel(model, tokenizer, ModelSource(name, SourceKind.HF_DIR, None), time.perf_counter() - start)
    return (hf if keep_hf else None), loaded


def _engine(loaded: LoadedModel, device: torch.device, dtype: torch.dtype, **opts):
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM

    return LLM.from_config(EngineConfig(model=loaded.source.name, device=device.type,
                                        dtype=str(dtype).removeprefix("torch."), **opts), loaded)


# -- inputs ---------------------------------------------------------------------------------------------
def random_images(sizes: tuple[tuple[int, int], ...], n: int, seed: int) -> list[Image]:
    """`n` random RGB PIL images, sizes cycled."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (sizes[i % len(sizes)][1], sizes[i % len(sizes)][0], 3),
                                         dtype=np.uint8)) for i in range(n)]


def _words(rng: random.Random, n: int, top: int) -> str:
    """`n` word tokens below `top` (the lowest special id), none of them special."""
    return " ".join(f"w{rng.randrange(3, top)}" for _ in range(n))


def hf_inputs(family: str, ids: list[int], items: list[MediaItem], image_token_id: int) -> dict[str, torch.Tensor]:
    """What HF's model takes for our prepared prompt (on the host; same ids, same pixels)."""
    ids_t = torch.tensor([ids])
    out = {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t),
           "pixel_values": torch.from_numpy(np.stack([it.data for it in items]))}
    if family == "gemma3":
        out["token_type_ids"] = (ids_t == image_token_id).long()
    else:
        out["image_position_ids"] = torch.from_numpy(np.stack([it.extra for it in items]))
        out["mm_token_type_ids"] = (ids_t == image_token_id).long()
    return out


def _to(inputs: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(device, dtype=dtype if k == "pixel_values" else None) for k, v in inputs.items()}


# -- timing -----------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    """Give back the memory of what the caller just deleted (the caller must `del` its own names first)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 2)


class EncoderCalls:
    """Counts calls of a model's `encode_images` and the images they encode, while entered (an instance
    attribute shadows the method; deleting it on exit restores the method)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.calls = 0
        self.images = 0

    def __enter__(self) -> "EncoderCalls":
        method = self.model.encode_images

        def counted(pixels: torch.Tensor, positions: torch.Tensor | None = None):
            self.calls += 1
            self.images += pixels.shape[0]
            return method(pixels, positions)

        self.model.encode_images = counted
        return self

    def __exit__(self, *exc) -> None:
        del self.model.encode_images


# -- check --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    """fp32 means fp32 for the comparison: cuDNN's TF32 convolutions (the patch embedding) would cost ~1e-3."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _prompt_logits(llm: LLM, ids: list[int], items: list[MediaItem]) -> torch.Tensor:
    """Our logits at the last prompt position (the whole prompt in one step)."""
    from gemmaserve.engine.sampling_params import SamplingParams

    eng = llm.engine
    rid = eng.add_request("", SamplingParams(max_tokens=1), prompt_ids=ids, media=items)
    parts = eng.internals()
    plan = parts.scheduler.schedule()
    parts.runner.apply(plan)
    logits = parts.runner.forward(plan.seqs)
    eng.abort_request(rid)
    if logits is None:
        raise RuntimeError("the prompt did not fit one step")
    return logits[0].float().cpu()


def section_check(res: dict, device: torch.device) -> None:
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from helpers import save_gemma4_vision_checkpoint, save_vision_checkpoint, tiny_hf_gemma4_vision, tiny_hf_vision

    rows = res["check"] = []   # filled as it goes: an error keeps what finished
    variants = (("gemma3", lambda: tiny_hf_vision(1234), save_vision_checkpoint),
                ("gemma4 e2b", lambda: tiny_hf_gemma4_vision(4321, "e2b"), save_gemma4_vision_checkpoint),
                ("gemma4 31b", lambda: tiny_hf_gemma4_vision(4321, "31b"), save_gemma4_vision_checkpoint))
    with _no_tf32():
        for variant, make, save in variants:
            with tempfile.TemporaryDirectory() as tmp:
                hf = make()
                path = save(hf, Path(tmp) / variant.replace(" ", "_"))
                _check_variant(rows, variant, hf.to(device), path, device)   # its engines go with its frame
                del hf
            _free(device)


def _check_variant(rows: list[dict], variant: str, hf: nn.Module, path: Path, device: torch.device) -> None:
    """Our engine loaded from `path` (the default attention backend, and torch's where that is another)
    against `hf`, fp32: 1- and 2-image prompts."""
    from helpers import IMG

    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM
    from gemmaserve.engine.sampling_params import SamplingParams

    family = "gemma3" if variant.startswith("gemma3") else "gemma4"
    mark = SPECIAL_TEXTS[family][0 if family == "gemma3" else 2]   # the prompt's image placeholder
    prompts = [(f"{mark} describe it", 1), (f"two {mark} and {mark} end", 2)]
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    common = dict(model=str(path), device=device.type, dtype="float32", max_num_batched_tokens=256, max_num_seqs=4,
                  kv_cache_memory=64 * MiB)
    base = LLM(**common)
    default = base.engine.info.attention_backend
    for backend in dict.fromkeys((default, "torch")):
        llm = base if backend == default else LLM.from_config(EngineConfig(**common, attention_backend=backend), base)
        errs, equal = [], []
        for k, (prompt, n) in enumerate(prompts):
            images = random_images(((40, 30), (24, 24)), n, seed=k)
            ids, items = llm.engine.inputs.prepare_images(prompt, images)
            inputs = _to(hf_inputs(family, ids, items, IMG), device, torch.float32)
            with torch.no_grad():
                ref = hf(**inputs).logits[0, -1].float().cpu()
                want = hf.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                   eos_token_id=[])[0, len(ids):].tolist()
            errs.append((_prompt_logits(llm, ids, items) - ref).abs().max().item())
            got = llm.generate(prompt, greedy, images=images, use_tqdm=False)[0].outputs[0].token_ids
            equal.append(list(got) == want)
        rows.append({"variant": variant, "backend": backend, "max_abs_logit_err": float(f"{max(errs):.3g}"),
                     "logits_ok": max(errs) < LOGIT_TOL, "greedy_tokens_equal": all(equal),
                     "err_by_images": {n: float(f"{e:.3g}") for (_, n), e in zip(prompts, errs)}})
        print("check", rows[-1], flush=True)


# -- ttft ---------------------------------------------------------------------------------------------
def section_ttft(res: dict, shapes: list[str], device: torch.device, dtype: torch.dtype, work: Workload) -> None:
    rows = res["ttft"] = []   # filled as it goes: an error keeps what finished
    for name in shapes:
        _ttft_shape(rows, name, device, dtype, work)   # its models go with its frame
        _free(device)


def _ttft_engine(loaded: LoadedModel, device: torch.device, dtype: torch.dtype, work: Workload) -> LLM:
    """No encoder cache, no prefix cache: each run encodes and prefills everything, as HF does."""
    return _engine(loaded, device, dtype, kv_cache_memory=work.kv_cache_memory, max_num_seqs=4,
                   max_num_batched_tokens=work.ttft_batched_tokens, encoder_cache_memory=0,
                   enable_prefix_caching=False)


def _ttft_times(ours: Callable[[], None], ours_e2e: Callable[[], None], reference: Callable[[], None],
                work: Workload, device: torch.device) -> dict:
    """Median ms of each after its warm-ups (kernels for this prefill length, allocator, clocks), and HF / ours."""
    times = {}
    for label, fn in (("ours", ours), ("ours_e2e", ours_e2e), ("hf", reference)):
        for _ in range(work.warmups):
            fn()
        times[label] = [_timed(fn, device) for _ in range(work.runs)]
    row = {"ours_ms": _ms(times["ours"]), "ours_e2e_ms": _ms(times["ours_e2e"]), "hf_ms": _ms(times["hf"])}
    row["hf_over_ours"] = round(row["hf_ms"] / row["ours_ms"], 2)
    row["runs_ms"] = {k: [round(t * 1e3, 2) for t in v] for k, v in times.items()}
    return row


def _ttft_shape(rows: list[dict], name: str, device: torch.device, dtype: torch.dtype, work: Workload) -> None:
    from gemmaserve.engine.sampling_params import SamplingParams

    shape = SHAPES[name]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    hf, loaded = build_models(name, dtype, device)
    llm = _ttft_engine(loaded, device, dtype, work)
    eng = llm.engine
    layout = eng.inputs.image_layout
    rng = random.Random(7)
    for n in work.image_counts:
        images = random_images(shape.image_sizes, n, seed=n)
        prompt = "<bos> " + _words(rng, 32, shape.specials[0]) + "".join(
            f" {layout.placeholder} {_words(rng, 4, shape.specials[0])}" for _ in range(n)) + " w5"
        ids, items = eng.inputs.prepare_images(prompt, images)
        host = hf_inputs(shape.family, ids, items, layout.token_id)

        def ours() -> None:
            eng.add_request("", params, prompt_ids=ids, media=items)
            while eng.has_unfinished_requests():
                eng.step()

        def ours_e2e() -> None:
            llm.generate(prompt, params, images=images, use_tqdm=False)

        def reference() -> None:
            with torch.inference_mode():
                hf.generate(**_to(host, device, dtype), max_new_tokens=1, do_sample=False, pad_token_id=0)

        row = {"shape": name, "images": n, "prompt_tokens": len(ids), "image_tokens": sum(it.length for it in items),
               **_ttft_times(ours, ours_e2e, reference, work, device)}
        rows.append(row)
        print("ttft", row, flush=True)


# -- audio and video ------------------------------------------------------------------------------------
def section_media(res: dict, shapes: list[str], device: torch.device, dtype: torch.dtype, work: Workload) -> None:
    rows = res["media"] = []
    for name in [s for s in shapes if SHAPES[s].audio is not None]:
        _media_shape(rows, name, device, dtype, work)
        _free(device)


def encoded_video(frames: int, size: tuple[int, int], seed: int) -> bytes:
    """An MP4 (MPEG-4 part 2) of `frames` random frames at 2 fps, as a user would upload it."""
    import io

    import av

    rng = np.random.default_rng(seed)
    w, h = size
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=2)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for _ in range(frames):
            pic = np.repeat(np.repeat(rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8), 16, 0), 16, 1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pic, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def hf_media_inputs(ids: list[int], items: list[MediaItem], specials: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """What HF's Gemma 4 takes for our prepared prompt with audio clips or video frames (same ids and features)."""
    ids_t = torch.tensor([ids])
    out = {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t)}
    types = torch.zeros_like(ids_t)
    clips = [it for it in items if it.modality.value == "audio"]
    frames = [it for it in items if it.modality.value == "video"]
    if clips:
        t = max(len(it.extra) for it in clips)
        feats = np.zeros((len(clips), t, clips[0].data.shape[1]), dtype=np.float32)
        mask = np.zeros((len(clips), t), dtype=bool)
        for i, it in enumerate(clips):
            feats[i, :len(it.extra)], mask[i, :len(it.extra)] = it.data, it.extra
        out["input_features"], out["input_features_mask"] = torch.from_numpy(feats), torch.from_numpy(mask)
        types[ids_t == specials["audio"]] = 3
    if frames:
        out["pixel_values_videos"] = torch.from_numpy(np.stack([it.data for it in frames]))
        out["video_position_ids"] = torch.from_numpy(np.stack([it.extra for it in frames]))
        out["num_frames_per_video"] = torch.tensor([len(frames)])
        types[ids_t == specials["video"]] = 2
    out["mm_token_type_ids"] = types
    return out


def _media_shape(rows: list[dict], name: str, device: torch.device, dtype: torch.dtype, work: Workload) -> None:
    from gemmaserve.engine.sampling_params import SamplingParams
    from gemmaserve.models.multimodal import Modality

    shape = SHAPES[name]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    hf, loaded = build_models(name, dtype, device)
    llm = _ttft_engine(loaded, device, dtype, work)
    eng = llm.engine
    layouts = eng.inputs.layouts
    specials = {"audio": layouts[Modality.AUDIO].token_id, "video": layouts[Modality.VIDEO].token_id}
    rng = random.Random(11)
    rate = layouts[Modality.AUDIO].processor.config.sampling_rate
    cases = []
    for n in work.clip_counts:
        clips = [(0.1 * np.random.default_rng(n * 10 + i).standard_normal(int(work.clip_seconds * rate)))
                 .astype(np.float32) for i in range(n)]
        cases.append((f"{n} x {work.clip_seconds:g} s audio", dict(audio=clips), layouts[Modality.AUDIO].placeholder, n))
    video = encoded_video(work.video_frames, shape.image_sizes[0], seed=3)
    cases.append((f"{work.video_frames}-frame video", dict(videos=[video]), layouts[Modality.VIDEO].placeholder, 1))
    for label, inputs, placeholder, count in cases:
        prompt = "<bos> " + _words(rng, 32, shape.specials[0]) + "".join(
            f" {placeholder} {_words(rng, 4, shape.specials[0])}" for _ in range(count)) + " w5"
        ids, items = eng.inputs.prepare(prompt, **inputs)
        host = hf_media_inputs(ids, items, specials)
        float_keys = ("input_features", "pixel_values_videos")

        def ours() -> None:
            eng.add_request("", params, prompt_ids=ids, media=items)
            while eng.has_unfinished_requests():
                eng.step()

        def ours_e2e() -> None:
            llm.generate(prompt, params, use_tqdm=False, **inputs)

        def reference() -> None:
            moved = {k: v.to(device, dtype=dtype if k in float_keys else None) for k, v in host.items()}
            with torch.inference_mode():
                hf.generate(**moved, max_new_tokens=1, do_sample=False, pad_token_id=0)

        row = {"shape": name, "input": label, "prompt_tokens": len(ids), "media_tokens": sum(it.length for it in items),
               **_ttft_times(ours, ours_e2e, reference, work, device)}
        rows.append(row)
        print("media", row, flush=True)


# -- throughput -------------------------------------------------------------------------------------------
def mixed_workload(shape: VisionShape, placeholder: str, work: Workload,
                   seed: int) -> tuple[list[str], list[list[Image] | None]]:
    """Prompts and their images: even requests carry one image of a pool of `work.pool` (so images repeat),
    after text that differs per request (no prefix-cache hit can cover an image); odd ones are text only."""
    rng = random.Random(seed)
    pool = random_images(shape.image_sizes, work.pool, seed=seed)
    half = work.prompt_tokens // 2
    top = shape.specials[0]
    prompts, images = [], []
    for i in range(work.requests):
        if i % 2 == 0:
            rest = work.prompt_tokens - half
            prompts.append(f"<bos> {_words(rng, half, top)} {placeholder} {_words(rng, rest, top)}")
            images.append([pool[(i // 2) % work.pool]])
        else:
            prompts.append(f"<bos> {_words(rng, work.prompt_tokens, top)}")
            images.append(None)
    return prompts, images


def section_throughput(res: dict, shapes: list[str], device: torch.device, dtype: torch.dtype,
                       work: Workload) -> None:
    from gemmaserve.config.engine import EngineConfig

    rows = res["throughput"] = []
    default_cache = EngineConfig.__dataclass_fields__["encoder_cache_memory"].default
    for name in shapes:
        _, loaded = build_models(name, dtype, device, keep_hf=False)
        for mode, cache_bytes in (("on", default_cache), ("off", 0)):
            rows.append(_throughput_row(loaded, name, mode, cache_bytes, device, dtype, work))
            print("throughput", rows[-1], flush=True)
            _free(device)
        del loaded
        _free(device)
        on, off = rows[-2], rows[-1]
        on["tok_s_on_over_off"] = round(on["out_tok_s"] / off["out_tok_s"], 3)


def _throughput_row(loaded: LoadedModel, name: str, mode: str, cache_bytes: int, device: torch.device,
                    dtype: torch.dtype, work: Workload) -> dict:
    from gemmaserve.engine.sampling_params import SamplingParams

    shape = SHAPES[name]
    params = SamplingParams(max_tokens=work.new_tokens, ignore_eos=True)
    llm = _engine(loaded, device, dtype, kv_cache_memory=work.kv_cache_memory, max_num_seqs=work.requests,
                  max_num_batched_tokens=work.batched_tokens, encoder_cache_memory=cache_bytes)
    placeholder = llm.engine.inputs.image_layout.placeholder
    # Warm-up on the same shapes with other text and images (none of the measured ones gets cached).
    warm_prompts, warm_images = mixed_workload(shape, placeholder, work, seed=100)
    llm.generate(warm_prompts, params, images=warm_images, use_tqdm=False)
    prompts, images = mixed_workload(shape, placeholder, work, seed=1)
    parts = llm.engine.internals()
    cache = parts.runner.media.cache
    encoded, hits = cache.encoded, cache.shared_hits
    outs: list = []
    with EncoderCalls(parts.model) as counter:
        secs = _timed(lambda: outs.extend(llm.generate(prompts, params, images=images, use_tqdm=False)), device)
    new = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"shape": name, "encoder_cache": mode, "encoder_cache_bytes": cache_bytes, "requests": work.requests,
            "image_requests": sum(im is not None for im in images), "distinct_images": work.pool,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs), "new_tokens": new, "wall_s": round(secs, 3),
            "out_tok_s": round(new / secs, 1), "encoder_calls": counter.calls, "images_encoded": counter.images,
            "cache_encoded": cache.encoded - encoded, "cache_shared_hits": cache.shared_hits - hits}


# -- main -----------------------------------------------------------------------------------------------
SECTIONS = ("check", "ttft", "media", "throughput")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sections", nargs="*", default=list(SECTIONS), help=f"any of {', '.join(SECTIONS)}")
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated, of {', '.join(SHAPES)} (default {','.join(REAL_SHAPES)}; "
                             f"--tiny: {','.join(TINY_SHAPES)})")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny configs and a small workload (CPU tests)")
    parser.add_argument("--runs", type=int, default=None, help="ttft: timed runs per configuration (median)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    work = TINY_WORKLOAD if args.tiny else Workload()
    if args.runs is not None:
        work = replace(work, runs=args.runs)
    shapes = [s for s in (args.shapes or ",".join(TINY_SHAPES if args.tiny else REAL_SHAPES)).split(",") if s]
    unknown = [s for s in [*shapes, *args.sections] if s not in SHAPES and s not in SECTIONS]
    if unknown:
        parser.error(f"unknown shape or section: {', '.join(unknown)}")
    import transformers

    out = Path(os.environ.get("OUT", "bench-out")) / "gpu_vision.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    res: dict = {"device": machine, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
                 "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"), "shapes": shapes,
                 "workload": asdict(work)}
    run_sections(res, args.sections, {
        "check": lambda: section_check(res, device),
        "ttft": lambda: section_ttft(res, shapes, device, dtype, work),
        "media": lambda: section_media(res, shapes, device, dtype, work),
        "throughput": lambda: section_throughput(res, shapes, device, dtype, work),
    }, out)
    print(json.dumps(res, indent=1))
    print(summary(res))
    return exit_status(res, CHECKS)


# Rows that pass or fail (bench/sections.py): the exit status is 1 if one fails or a section raised.
CHECKS = {"check": lambda r: r["logits_ok"] and r["greedy_tokens_equal"]}


def summary(res: dict) -> str:
    """The figures as a short table (the JSON has everything)."""
    lines = [f"{res['device']}  {res['dtype']}  torch {res['torch']}  transformers {res['transformers']}"]
    for r in res.get("check", []):
        lines.append(f"check   {r['variant']:<12} {r['backend']:<7} max|dlogit| {r['max_abs_logit_err']:<9.3g} "
                     f"ok={r['logits_ok']}  greedy equal={r['greedy_tokens_equal']}")
    for r in res.get("ttft", []):
        lines.append(f"ttft    {r['shape']:<12} {r['images']} img {r['prompt_tokens']:5d} tok  "
                     f"ours {r['ours_ms']:8.2f} ms"
                     f"  (e2e {r['ours_e2e_ms']:8.2f})  HF {r['hf_ms']:8.2f} ms  HF/ours {r['hf_over_ours']}x")
    for r in res.get("media", []):
        lines.append(f"media   {r['shape']:<12} {r['input']:<18} {r['prompt_tokens']:5d} tok  ours {r['ours_ms']:8.2f} ms"
                     f"  (e2e {r['ours_e2e_ms']:8.2f})  HF {r['hf_ms']:8.2f} ms  HF/ours {r['hf_over_ours']}x")
    for r in res.get("throughput", []):
        lines.append(f"thruput {r['shape']:<12} cache {r['encoder_cache']:<3}  {r['out_tok_s']:9.1f} tok/s  "
                     f"{r['wall_s']:7.3f} s  encoder calls {r['encoder_calls']} ({r['images_encoded']} images)")
    for key in [k for k in res if k.endswith("_error")]:
        lines.append(f"{key}: {res[key][:150]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
