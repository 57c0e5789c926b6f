"""Random-weight Gemma 3 models at real sizes, for speed measurements (speed does not depend on weight
values). Shapes from the public configs (../shared/reference/gemma-architecture.md §7)."""

from __future__ import annotations

import time

import torch

from ..models.gemma3 import Gemma3Config, Gemma3ForCausalLM
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
def random_gemma3(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LoadedModel:
    start = time.perf_counter()
    cfg = gemma3_config(name)
    with torch.device(device):
        model = Gemma3ForCausalLM(cfg, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for pname, p in model.named_parameters():
        scale = 0.1 if "norm" in pname else p.shape[-1] ** -0.5
        p.normal_(0.0, scale, generator=gen)
    model.eval()
    return LoadedModel(model, synthetic_tokenizer(cfg.vocab_size), ModelSource(name, SourceKind.HF_DIR, None),
                       time.perf_counter() - start)
