"""Random-weight Gemma 3 / Gemma 4 models at real sizes, for speed and memory measurements (speed does
not depend on weight values). Shapes from the public configs (../shared/reference/gemma-architecture.md
§7); Gemma 4's are written as hub config.json dicts and parsed by the model's own config parser."""

from __future__ import annotations

import dataclasses
import time

import torch

from ..models.base import CausalLM
from ..models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from ..models.gemma4 import Gemma4Config, Gemma4ForCausalLM
from ..models.layers import RopeParams
from ..models.loader import LoadedModel, ModelSource, SourceKind
from ..models.tokenizer import Tokenizer

GEMMA3_CONFIGS = {
    # layers, hidden, heads, kv heads, head dim, intermediate, window, qpas, linear rope factor
    "gemma3-1b": (26, 1152, 4, 1, 256, 6912, 512, 256, 1.0),
    "gemma3-4b": (34, 2560, 8, 4, 256, 10240, 1024, 256, 8.0),
    "gemma3-12b": (48, 3840, 16, 8, 256, 15360, 1024, 256, 8.0),
    "gemma3-27b": (62, 5376, 32, 16, 128, 21504, 1024, 168, 8.0),
}


def _gemma4(layers: int, every: int, hidden: int, heads: int, kv: int, global_kv: int, inter: int, window: int,
            **extra) -> dict:
    types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    return {**dict(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", num_hidden_layers=layers,
                   layer_types=types, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                   num_global_key_value_heads=global_kv, head_dim=256, global_head_dim=512, intermediate_size=inter,
                   sliding_window=window, final_logit_softcapping=30.0, vocab_size=262144,
                   hidden_size_per_layer_input=0), **extra}


GEMMA4_CONFIGS = {
    "gemma4-e2b": _gemma4(35, 5, 1536, 8, 1, 1, 6144, 512, hidden_size_per_layer_input=256,
                          num_kv_shared_layers=20, use_double_wide_mlp=True),
    "gemma4-e4b": _gemma4(42, 6, 2560, 8, 2, 2, 10240, 512, hidden_size_per_layer_input=256,
                          num_kv_shared_layers=18),
    "gemma4-12b": {**_gemma4(48, 6, 3840, 16, 8, 1, 15360, 1024, attention_k_eq_v=True,
                             max_position_embeddings=262144),
                   "architectures": ["Gemma4UnifiedForCausalLM"], "model_type": "gemma4_unified_text"},
    "gemma4-26b-a4b": _gemma4(30, 6, 2816, 16, 8, 2, 2112, 1024, attention_k_eq_v=True, enable_moe_block=True,
                              num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                              max_position_embeddings=262144),
    "gemma4-31b": _gemma4(60, 6, 5376, 32, 16, 4, 21504, 1024, attention_k_eq_v=True,
                          max_position_embeddings=262144),
    # Not a real model: the E2B's structure (per-layer inputs, a KV-shared tail, window 512) at a CPU size.
    "gemma4-tiny": _gemma4(10, 5, 512, 4, 1, 1, 2048, 512, hidden_size_per_layer_input=64, num_kv_shared_layers=4,
                           vocab_size=32768),
}


def model_config(name: str, layers: int | None = None) -> Gemma3Config | Gemma4Config:
    """The config of a real model shape by name (gemma3-*, gemma4-*); `layers`: only the first that many
    (the same layer shapes and pattern, for a model too large for one card at full depth)."""
    if name in GEMMA3_CONFIGS:
        cfg = gemma3_config(name)
        if layers is None:
            return cfg
        return dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers])
    if name in GEMMA4_CONFIGS:
        raw = GEMMA4_CONFIGS[name]
        if layers is not None:
            raw = {**raw, "num_hidden_layers": layers, "layer_types": raw["layer_types"][:layers]}
        return Gemma4Config.from_hf(raw)
    raise KeyError(f"unknown model shape {name!r}; known: {', '.join([*GEMMA3_CONFIGS, *GEMMA4_CONFIGS])}")


def gemma3_config(name: str, max_position_embeddings: int = 131072) -> Gemma3Config:
    layers, hidden, heads, kv, hd, inter, window, qpas, factor = GEMMA3_CONFIGS[name]
    return Gemma3Config(
        vocab_size=262144 if name == "gemma3-1b" else 262208, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
        layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)),
        sliding_window=window, query_pre_attn_scalar=qpas, rope_global=RopeParams(1e6, factor),
        rope_local=RopeParams(1e4), max_position_embeddings=max_position_embeddings)


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """Token i decodes to " w<i>" (ids 0-2: pad, eos, bos): enough for the engine's detokenizer."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    return Tokenizer.from_backend(backend, bos=2, eos=1)


@torch.inference_mode()
def random_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 config: Gemma3Config | Gemma4Config | None = None) -> LoadedModel:
    """A real-size model of shape `name` (or of `config`, under that name) with random weights (norm gains
    near their identity, so activations stay in range in bf16)."""
    start = time.perf_counter()
    cfg = model_config(name) if config is None else config
    cls: type[CausalLM] = Gemma3ForCausalLM if isinstance(cfg, Gemma3Config) else Gemma4ForCausalLM
    with torch.device(device):
        model = cls(cfg, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    identity = 0.0 if cls is Gemma3ForCausalLM else 1.0   # (1 + w) norms vs w norms
    for pname, p in model.named_parameters():
        if "norm" in pname or pname.endswith(("scale", "layer_scalar")):
            p.normal_(identity, 0.1, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    model.eval()
    return LoadedModel(model, synthetic_tokenizer(cfg.vocab_size), ModelSource(name, SourceKind.HF_DIR, None),
                       time.perf_counter() - start)


random_gemma3 = random_model   # the GPU benchmarks' older name
