"""Hugging Face transformers as the reference: the same weights in HF's own Gemma3ForCausalLM /
Gemma4ForCausalLM.

Used by the tests (numerical parity) and the benchmarks (speed baseline); never by the engine. The HF
model can share our tensors instead of copying them (`share=True`: fused q/k/v and gate/up rows become
views), so a 31B reference fits next to ours on one GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.base import CausalLM
from ..models.gemma3 import Gemma3ForCausalLM


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Our parameters (and buffers) under HF names: fused qkv / gate_up split back into their parts."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict(keep_vars=False).items():
        for fused, parts in (("qkv_proj.weight", ("q_proj", "k_proj", "v_proj")),
                             ("gate_up_proj.weight", ("gate_proj", "up_proj"))):
            if name.endswith(fused) and ".experts." not in name:
                base = name[: -len(fused)]
                for part, t in zip(parts, p.split(model.shard_sizes(name), dim=0)):
                    out[f"{base}{part}.weight"] = t
                break
        else:
            out[name] = p
    return out


def build_hf_model(model: CausalLM, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                   device: str | torch.device = "cpu", share: bool = False) -> nn.Module:
    """A transformers model holding exactly our model's weights (copies, or views with `share` when
    dtype and device already match)."""
    import transformers

    if isinstance(model, Gemma3ForCausalLM):
        hf_cfg = transformers.Gemma3TextConfig(**model.config.to_hf_dict())
        cls = transformers.Gemma3ForCausalLM
    else:
        hf_cfg = transformers.Gemma4TextConfig(**model.config.to_hf_dict())
        cls = transformers.Gemma4ForCausalLM   # the 12B unified text tower is this architecture without PLE/MoE
    hf_cfg._attn_implementation = attn_implementation
    hf_cfg.bos_token_id, hf_cfg.eos_token_id, hf_cfg.pad_token_id = 2, 1, 0
    if share:   # parameters on meta, then our tensors assigned; buffers (RoPE tables, scales) built for real
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            hf = cls(hf_cfg)
    else:
        with _no_init():
            hf = cls(hf_cfg)
    hf.requires_grad_(False)   # assigned parameters keep this flag: ours may be inference tensors
    sd = hf_state_dict(model)
    sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])   # tied unless ours has a head of its own
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=share)
    missing = [m for m in missing if not m.endswith(("inv_freq", "embed_scale"))]
    if missing or unexpected:
        raise RuntimeError(f"HF reference weights do not line up: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if share:
        hf.tie_weights()
        return hf.to(device=device).eval()   # moves only the buffers: the parameters are ours, already there
    return hf.to(device=device, dtype=dtype).eval()


def _no_init():
    """Skip HF's random init (seconds for a 262k vocabulary): every weight is overwritten anyway."""
    import contextlib

    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()
