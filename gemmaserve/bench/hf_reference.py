"""Hugging Face transformers as the reference: the same weights in HF's own Gemma3ForCausalLM.

Used by the tests (numerical parity) and the benchmarks (speed baseline); never by the engine.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.gemma3 import Gemma3Config


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our parameters under HF names: fused qkv / gate_up split back into their parts."""
    cfg: Gemma3Config = model.config
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            for part, t in zip(("q_proj", "k_proj", "v_proj"), p.split((q, kv, kv))):
                out[f"{base}{part}.weight"] = t
        elif name.endswith("gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            for part, t in zip(("gate_proj", "up_proj"), p.split(cfg.intermediate_size)):
                out[f"{base}{part}.weight"] = t
        else:
            out[name] = p
    return out


def build_hf_model(model: nn.Module, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                   device: str | torch.device = "cpu") -> nn.Module:
    """A transformers Gemma3ForCausalLM holding exactly our model's weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    hf_cfg = Gemma3TextConfig(**model.config.to_hf_dict())
    hf_cfg._attn_implementation = attn_implementation
    hf_cfg.bos_token_id, hf_cfg.eos_token_id, hf_cfg.pad_token_id = 2, 1, 0
    with _no_init():
        hf = Gemma3ForCausalLM(hf_cfg)
    sd = hf_state_dict(model)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"HF reference weights do not line up: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hf.to(device=device, dtype=dtype).eval()


def _no_init():
    """Skip HF's random init (seconds for a 262k vocabulary): every weight is overwritten anyway."""
    import contextlib

    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()
