"""Gemma 4 text model: Gemma4ForCausalLM, the text tower of Gemma4ForConditionalGeneration, and the
12B `gemma4_unified` text tower (../shared/reference/gemma-architecture.md §4, §7-§10).

    x = E[ids] * sqrt(H)  (scale cast to the weight dtype);  ple = per-layer inputs (E2B/E4B)
    for each layer l:
        x = x + post_attn_norm(attn(in_norm(x)))                 q/k norms (w), value norm, scale 1
        m = mlp(pre_ffw_norm(x))                                  double width on KV-shared layers (E2B)
        [MoE]  m = post_ffw_norm_1(m) + post_ffw_norm_2(experts(pre_ffw_norm_2(x), router(x)))
        x = x + post_ffw_norm(m)
        [PLE]  x = x + post_ple_norm(proj(gelu(gate(x)) * ple[:, l]))
        x = x * layer_scalar_l
    logits = 30 * tanh((final_norm(x) @ E^T) / 30)

Everything comes from the config: layer types (the last one is forced to full attention), head dim
and KV heads per layer (global_head_dim / num_global_key_value_heads, or 5.x's per_layer_config),
K = V on full layers, RoPE per layer type (sliding: default; full: proportional), KV sharing
(consumers read the last layer of their type before the shared range and never use their own k/v
weights), MoE and PLE.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserInputError
from ..kv.spec import AttentionKind, LayerSpec
from .base import CausalLM, ModelInputs, ModelPreferences
from .fused_ops import NormKind, add_rms_norm, gelu_mul, rms_norm
from .layers import Attention, AttentionParams, Embedding, GeGLU, Linear, RMSNorm, RopeKind, RopeParams, softcap
from .moe import Experts, Router

if TYPE_CHECKING:
    from .lora import LoRABatch

log = logging.getLogger(__name__)

FULL = "full_attention"
SLIDING = "sliding_attention"

# transformers' defaults for keys a config.json leaves out (Gemma4TextConfig, Gemma4UnifiedTextConfig).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma4_text": dict(
        vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
        rms_norm_eps=1e-6, sliding_window=512, final_logit_softcapping=None, use_bidirectional_attention=None,
        vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256, attention_k_eq_v=False,
        num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False, num_experts=None,
        top_k_experts=None, moe_intermediate_size=None, attention_bias=False),
    "gemma4_unified_text": dict(
        vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=262_144,
        rms_norm_eps=1e-6, sliding_window=1024, final_logit_softcapping=None, use_bidirectional_attention="vision",
        vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=0, attention_k_eq_v=False,
        num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False, num_experts=None,
        top_k_experts=None, moe_intermediate_size=None, attention_bias=False),
}
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


@dataclass(frozen=True)
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]              # per layer (sliding: head_dim, full: global_head_dim)
    kv_heads: tuple[int, ...]               # per layer
    kv_sources: tuple[int | None, ...]      # per layer: the producer a KV-shared layer reads, else None
    mlp_sizes: tuple[int, ...]              # per layer (double width on KV-shared layers of E2B)
    sliding_window: int
    rope: dict[str, RopeParams]             # per layer type
    attention_k_eq_v: bool = False
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 131_072
    hidden_size_per_layer_input: int = 0    # PLE width (0: no per-layer embeddings)
    vocab_size_per_layer_input: int = 262_144
    num_experts: int = 0                    # 0: no MoE block
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    bidirectional_vision: bool = False      # images attend bidirectionally on sliding layers (vision issue)
    multimodal: bool = False                # the checkpoint has vision/audio towers (only the text tower runs)
    architecture: str = "Gemma4ForCausalLM"
    tie_word_embeddings: bool = True        # false: the output head is the checkpoint's lm_head.weight

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        for name in ("layer_types", "head_dims", "kv_heads", "kv_sources", "mlp_sizes"):
            if len(getattr(self, name)) != n:
                raise UserInputError(f"config has {len(getattr(self, name))} {name} for {n} layers")
        unknown = set(self.layer_types) - {FULL, SLIDING}
        if unknown:
            raise UserInputError(f"unsupported layer types {sorted(unknown)} (expected {FULL!r} or {SLIDING!r})")
        for i, (heads, d) in enumerate(zip(self.kv_heads, self.head_dims)):
            if heads < 1 or self.num_attention_heads % heads:
                raise UserInputError(f"layer {i}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                                     f"its {heads} KV heads")
            if d < 2 or d & (d - 1):
                raise UserInputError(f"layer {i}: head_dim {d} is not a power of two")
        for i, src in enumerate(self.kv_sources):
            if src is None:
                continue
            if not 0 <= src < i or self.kv_sources[src] is not None or self.layer_types[src] != self.layer_types[i]:
                raise UserInputError(f"layer {i} cannot share the KV of layer {src}")
            if (self.head_dims[src], self.kv_heads[src]) != (self.head_dims[i], self.kv_heads[i]):
                raise UserInputError(f"layer {i} shares the KV of layer {src} but has another head shape")
        if set(self.layer_types) - set(self.rope):
            raise UserInputError(f"rope_parameters lack {sorted(set(self.layer_types) - set(self.rope))}")
        if self.num_experts and not 0 < self.top_k_experts <= self.num_experts:
            raise UserInputError(f"top_k_experts must be in [1, {self.num_experts}], got {self.top_k_experts}")

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def kv_layer_specs(self, dtype: torch.dtype) -> list[LayerSpec]:
        """What the KV cache needs of each layer (no weights needed: benchmarks size real shapes)."""
        return [LayerSpec(kind=AttentionKind.FULL if t == FULL else AttentionKind.SLIDING, num_kv_heads=heads,
                          head_dim=d, dtype=dtype, window=None if t == FULL else self.sliding_window, kv_source=src)
                for t, heads, d, src in zip(self.layer_types, self.kv_heads, self.head_dims, self.kv_sources)]

    # -- parsing --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Gemma4Config":
        """From a Hugging Face config.json: Gemma4ForCausalLM (gemma4_text), or the text_config of
        Gemma4ForConditionalGeneration / gemma4_unified."""
        top_type = cfg.get("model_type")
        architecture = (cfg.get("architectures") or ["Gemma4ForCausalLM"])[0]
        multimodal = bool(cfg.get("vision_config") or cfg.get("audio_config"))
        text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
        text_type = text.get("model_type") or {"gemma4": "gemma4_text",
                                               "gemma4_unified": "gemma4_unified_text"}.get(top_type, top_type)
        if text_type not in _DEFAULTS:
            text_type = "gemma4_unified_text" if "unified" in str(text_type) else "gemma4_text"
        c = dict(_DEFAULTS[text_type])
        c.update({k: v for k, v in text.items() if k in c or k in (
            "layer_types", "rope_parameters", "per_layer_config", "global_head_dim", "num_global_key_value_heads")})
        if c["hidden_activation"] != "gelu_pytorch_tanh":
            raise UserInputError(f"unsupported hidden_activation {c['hidden_activation']!r} (Gemma 4 uses "
                                 "gelu_pytorch_tanh)")
        if c["attention_bias"]:
            raise UserInputError("attention_bias is not supported (Gemma 4 has no attention biases)")
        # the head's tie is the outer config's (transformers reads the model's own config, the composite one)
        tie = cfg.get("tie_word_embeddings", True)
        if not isinstance(tie, bool):
            raise UserInputError(f"config tie_word_embeddings must be true or false, got {tie!r}")
        if c["use_bidirectional_attention"] == "all":
            raise UserInputError("bidirectional (embedding) Gemma 4 models are not supported for generation")
        n = int(c["num_hidden_layers"])
        layer_types = list(c.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)])
        if len(layer_types) != n:
            raise UserInputError(f"config lists {len(layer_types)} layer_types for {n} layers")
        if layer_types[-1] != FULL:
            log.warning("the last layer of a Gemma 4 model is always full attention; forcing layer %d to %s",
                        n - 1, FULL)
            layer_types[-1] = FULL
        head_dims = [int(c["head_dim"])] * n
        kv_heads = [int(c["num_key_value_heads"])] * n
        k_eq_v = bool(c["attention_k_eq_v"])
        overrides = c.get("per_layer_config")
        if isinstance(overrides, dict):
            for key, values in overrides.items():
                layers = ([int(key)] if str(key).lstrip("-").isdigit()
                          else [i for i, t in enumerate(layer_types) if t == key])
                if not layers or not isinstance(values, dict):
                    raise UserInputError(f"per_layer_config entry {key!r} names no layer")
                for name, value in values.items():
                    if name not in ("head_dim", "num_key_value_heads"):
                        raise UserInputError(f"per_layer_config overrides {name!r}, which is not supported")
                    for i in layers:
                        (head_dims if name == "head_dim" else kv_heads)[i] = int(value)
        else:
            global_kv = c.get("num_global_key_value_heads")
            for i, t in enumerate(layer_types):
                if t == FULL:
                    head_dims[i] = int(c.get("global_head_dim") or 512)
                    if k_eq_v and global_kv is not None:
                        kv_heads[i] = int(global_kv)
        kv_sources = _kv_sources(layer_types, int(c["num_kv_shared_layers"]))
        inter = c["intermediate_size"]
        if isinstance(inter, list):
            raise UserInputError("per-layer intermediate_size lists are not supported")
        mlp_sizes = [int(inter) * (2 if c["use_double_wide_mlp"] and kv_sources[i] is not None else 1)
                     for i in range(n)]
        rope_params = c.get("rope_parameters") or _DEFAULT_ROPE
        rope = {t: RopeParams.from_hf(rope_params[t], f"{t} layers") for t in set(layer_types) if t in rope_params}
        moe = bool(c["enable_moe_block"])
        if moe and not (c["num_experts"] and c["top_k_experts"] and c["moe_intermediate_size"]):
            raise UserInputError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        return cls(
            vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]), num_hidden_layers=n,
            num_attention_heads=int(c["num_attention_heads"]), layer_types=tuple(layer_types),
            head_dims=tuple(head_dims), kv_heads=tuple(kv_heads), kv_sources=tuple(kv_sources),
            mlp_sizes=tuple(mlp_sizes), sliding_window=int(c["sliding_window"]), rope=rope,
            attention_k_eq_v=k_eq_v, rms_norm_eps=float(c["rms_norm_eps"]),
            final_logit_softcapping=c["final_logit_softcapping"],
            max_position_embeddings=int(c["max_position_embeddings"]),
            hidden_size_per_layer_input=int(c["hidden_size_per_layer_input"] or 0),
            vocab_size_per_layer_input=int(c["vocab_size_per_layer_input"]),
            num_experts=int(c["num_experts"] or 0) if moe else 0, top_k_experts=int(c["top_k_experts"] or 0) if moe else 0,
            moe_intermediate_size=int(c["moe_intermediate_size"] or 0) if moe else 0,
            bidirectional_vision=c["use_bidirectional_attention"] == "vision", multimodal=multimodal,
            architecture=architecture, tie_word_embeddings=tie)

    @classmethod
    def from_gguf(cls, gguf) -> "Gemma4Config":
        """From llama.cpp's gemma4 metadata, as its converter writes it (convert_hf_to_gguf.py's Gemma4Model,
        llama.cpp conversion/gemma.py; read back by src/models/gemma4.cpp):

        * gemma4.block_count, embedding_length, head_count, context_length, attention.layer_norm_rms_epsilon,
          attention.sliding_window, final_logit_softcapping (absent: none);
        * attention.sliding_window_pattern: per layer, true = sliding (the last layer is full attention);
        * attention.key_length / value_length = global_head_dim (full layers), *_swa = head_dim (sliding);
        * attention.head_count_kv: one number, or per layer where the checkpoint has num_global_key_value_heads;
        * feed_forward_length: one number, or per layer with the double-wide MLP of the KV-shared layers;
        * attention.shared_kv_layers: the last n layers read earlier layers' KV (HF's rule, `_kv_sources`);
        * embedding_length_per_layer_input: PLE width (0: none); expert_count / expert_used_count /
          expert_feed_forward_length: the MoE block;
        * rope.freq_base (full layers) and rope.freq_base_swa; full layers' proportional RoPE is the tensor
          rope_freqs (1 for each rotated frequency pair, 1e30 for the others); rope.dimension_count_swa is the
          sliding layers' rotated width (all of head_dim: partial sliding RoPE is refused);
        * K = V (attention_k_eq_v): full layers without attn_v; an untied head: output.weight present;
          the vocabulary: token_embd's rows (the converter cuts them to the tokenizer's size).

        Tensors keep HF's values: norms as stored (no 1 + w, unlike Gemma 3), the experts' 3-D gate_up
        [E, 2I, H] and down [E, H, I] as they are; names in `Gemma4ForCausalLM.gguf_name`."""
        def key(name: str, default: Any = None, required: bool = True) -> Any:
            value = gguf.get(f"gemma4.{name}", default)
            if value is None and required:
                raise UserInputError(f"GGUF file lacks gemma4.{name}")
            return value

        n = int(key("block_count"))

        def per_layer(name: str, default: Any = None) -> list[int]:
            value = key(name, default)
            values = [int(v) for v in value] if hasattr(value, "__len__") else [int(value)] * n
            if len(values) != n:
                raise UserInputError(f"gemma4.{name} has {len(values)} entries for {n} layers")
            return values

        pattern = key("attention.sliding_window_pattern", None, required=False)
        if pattern is None:
            layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]
        elif hasattr(pattern, "__len__"):
            layer_types = [SLIDING if bool(s) else FULL for s in pattern]
        else:
            layer_types = [FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(n)]
        layer_types[-1] = FULL
        heads = int(key("attention.head_count"))
        kv_heads = per_layer("attention.head_count_kv")
        global_kv = key("attention.global_head_count_kv", None, required=False)
        d_full, d_sliding = int(key("attention.key_length", 512)), int(key("attention.key_length_swa", 256))
        head_dims = [d_full if t == FULL else d_sliding for t in layer_types]
        tensors = gguf.tensors_by_name()
        kv_sources = _kv_sources(layer_types, int(key("attention.shared_kv_layers", 0)))
        first_full = next(i for i, t in enumerate(layer_types) if t == FULL)
        k_eq_v = f"blk.{first_full}.attn_v.weight" not in tensors   # full layers without v_proj: V = K
        if global_kv is not None and k_eq_v:
            kv_heads = [int(global_kv) if t == FULL else h for t, h in zip(layer_types, kv_heads)]
        rotated_swa = key("rope.dimension_count_swa", None, required=False)
        if rotated_swa is not None and int(rotated_swa) != d_sliding:
            raise UserInputError(f"gemma4.rope.dimension_count_swa is {rotated_swa}: sliding layers rotating part "
                                 f"of their {d_sliding} head dims are not supported")
        partial = key("rope.partial_rotary_factor", None, required=False)
        if partial is None:
            partial = _partial_from_rope_freqs(gguf, d_full) if "rope_freqs.weight" in tensors else 0.25
        embed = tensors.get("token_embd.weight")
        ple = tensors.get("per_layer_token_embd.weight")
        experts = int(key("expert_count", 0, required=False) or 0)
        return cls(
            vocab_size=embed.shape[0] if embed is not None else len(gguf.strings("tokenizer.ggml.tokens")),
            hidden_size=int(key("embedding_length")), num_hidden_layers=n, num_attention_heads=heads,
            layer_types=tuple(layer_types), head_dims=tuple(head_dims), kv_heads=tuple(kv_heads),
            kv_sources=tuple(kv_sources), mlp_sizes=tuple(per_layer("feed_forward_length")),
            sliding_window=int(key("attention.sliding_window")),
            rope={SLIDING: RopeParams(float(key("rope.freq_base_swa", 1e4))),
                  FULL: RopeParams(float(key("rope.freq_base", 1e6)), kind=RopeKind.PROPORTIONAL,
                                   partial_rotary_factor=float(partial))},
            attention_k_eq_v=k_eq_v, rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            final_logit_softcapping=key("final_logit_softcapping", None, required=False),
            max_position_embeddings=int(key("context_length", 131072)),
            hidden_size_per_layer_input=int(key("embedding_length_per_layer_input", 0, required=False) or 0),
            vocab_size_per_layer_input=ple.shape[0] if ple is not None else 262_144,
            num_experts=experts, top_k_experts=int(key("expert_used_count", 0, required=False) or 0),
            moe_intermediate_size=int(key("expert_feed_forward_length", 0, required=False) or 0) if experts else 0,
            tie_word_embeddings="output.weight" not in tensors)   # llama.cpp: else token_embd is the head

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent transformers Gemma4TextConfig arguments (hub format: global_head_dim and
        num_global_key_value_heads, read by every transformers 5.x)."""
        full = [i for i, t in enumerate(self.layer_types) if t == FULL]
        sliding = [i for i, t in enumerate(self.layer_types) if t == SLIDING]
        first = self.num_hidden_layers - sum(s is not None for s in self.kv_sources)
        base_inter = self.mlp_sizes[0]
        return dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=base_inter,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.kv_heads[sliding[0]] if sliding else self.kv_heads[0],
            head_dim=self.head_dims[sliding[0]] if sliding else self.head_dims[0],
            global_head_dim=self.head_dims[full[0]], num_global_key_value_heads=self.kv_heads[full[0]],
            layer_types=list(self.layer_types), sliding_window=self.sliding_window,
            rope_parameters={t: r.to_hf() for t, r in self.rope.items()}, attention_k_eq_v=self.attention_k_eq_v,
            num_kv_shared_layers=self.num_hidden_layers - first,
            use_double_wide_mlp=any(m != base_inter for m in self.mlp_sizes),
            rms_norm_eps=self.rms_norm_eps, final_logit_softcapping=self.final_logit_softcapping,
            max_position_embeddings=self.max_position_embeddings,
            hidden_size_per_layer_input=self.hidden_size_per_layer_input,
            vocab_size_per_layer_input=self.vocab_size_per_layer_input,
            enable_moe_block=self.moe, num_experts=self.num_experts or None, top_k_experts=self.top_k_experts or None,
            moe_intermediate_size=self.moe_intermediate_size or None, tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=2, eos_token_id=1, pad_token_id=0)


def _kv_sources(layer_types: list[str], num_shared: int) -> list[int | None]:
    """HF's rule: layers from n - num_shared on read the KV of the last earlier layer of their type."""
    n = len(layer_types)
    if num_shared == 0:
        return [None] * n
    first = n - num_shared
    if not 0 < first < n:
        raise UserInputError(f"num_kv_shared_layers {num_shared} leaves no layer that stores KV ({n} layers)")
    producer = {t: max(i for i in range(first) if layer_types[i] == t)
                for t in set(layer_types[:first])}
    missing = set(layer_types[first:]) - set(producer)
    if missing:
        raise UserInputError(f"KV-shared layers of type {sorted(missing)} have no earlier layer to read from")
    return [None if i < first else producer[layer_types[i]] for i in range(n)]


def _partial_from_rope_freqs(gguf, head_dim: int) -> float:
    """llama.cpp stores proportional RoPE as per-frequency divisors: 1 for rotated pairs, huge for
    the pass-through ones."""
    factors = gguf.load("rope_freqs.weight").flatten()
    if factors.numel() != head_dim // 2:
        raise UserInputError(f"rope_freqs has {factors.numel()} entries, expected {head_dim // 2}")
    rotated = int((factors < 1e3).sum())
    return 2 * rotated / head_dim


def attention_params(cfg: Gemma4Config, layer: int) -> AttentionParams:
    full = cfg.layer_types[layer] == FULL
    return AttentionParams(
        layer=layer, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.kv_heads[layer],
        head_dim=cfg.head_dims[layer], scale=1.0, window=None if full else cfg.sliding_window,
        norm=NormKind(cfg.rms_norm_eps, 0.0), value_norm=True, k_eq_v=cfg.attention_k_eq_v and full,
        owns_kv=cfg.kv_sources[layer] is None, image_bidirectional=cfg.bidirectional_vision and not full)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer: int, dtype: torch.dtype, attention: AttentionParams | None = None):
        """`attention`: how the layer attends, if not as the config says (an MTP drafter's layers read
        a target layer's KV)."""
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = NormKind(eps, 0.0)
        self.layer_type = cfg.layer_types[layer]
        self.self_attn = Attention(attention or attention_params(cfg, layer), dtype)
        self.mlp = GeGLU(h, cfg.mlp_sizes[layer], dtype)
        self.input_layernorm = RMSNorm(h, eps, dtype, 0.0)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, 0.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, dtype, 0.0)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dtype, 0.0)
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)
        self.ple = cfg.hidden_size_per_layer_input > 0
        if self.ple:
            p = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = Linear(h, p, dtype)
            self.per_layer_projection = Linear(p, h, dtype)
            self.post_per_layer_input_norm = RMSNorm(h, eps, dtype, 0.0)
        self.moe = cfg.moe
        if self.moe:
            self.router = Router(h, cfg.num_experts, cfg.top_k_experts, eps, dtype)
            self.experts = Experts(h, cfg.moe_intermediate_size, cfg.num_experts, dtype)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps, dtype, 0.0)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps, dtype, 0.0)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps, dtype, 0.0)

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos_sin, attn, ple: torch.Tensor | None,
                next_norm: RMSNorm, lora: LoRABatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, its input-normed copy) -> the same for the next layer."""
        kind = self.kind
        x, h = add_rms_norm(x, self.self_attn(h, cos_sin, attn, lora), self.post_attention_layernorm.weight,
                            self.pre_feedforward_layernorm.weight, kind)
        m = self.mlp(h, lora)
        if self.moe:
            weights, idx = self.router(x)
            e = self.experts(rms_norm(x, self.pre_feedforward_layernorm_2.weight, kind), weights, idx, lora)
            m = (rms_norm(m, self.post_feedforward_layernorm_1.weight, kind)
                 + rms_norm(e, self.post_feedforward_layernorm_2.weight, kind))
        if not self.ple:
            return add_rms_norm(x, m, self.post_feedforward_layernorm.weight, next_norm.weight, kind,
                                self.layer_scalar)
        x, _ = add_rms_norm(x, m, self.post_feedforward_layernorm.weight, None, kind)
        gate = self.per_layer_input_gate(x)
        if gate.device.type == "cpu":   # fused_ops' op, one [gate | ple] row at a time: a [T, P] tensor runs as
            # one flat loop whose last elements take the scalar code (other bits for some rows)
            g = gelu_mul(torch.cat((gate, ple.to(gate.dtype)), -1), gate.shape[-1])
        else:
            g = F.gelu(gate, approximate="tanh") * ple
        return add_rms_norm(x, self.per_layer_projection(g), self.post_per_layer_input_norm.weight, next_norm.weight,
                            kind, self.layer_scalar)


class LayerRopes(nn.Module):
    """One fp32 frequency table per distinct (RoPE, head dim) of the layers; a model is never cast, so
    they stay fp32. `tables(positions)` gives each one's (cos, sin), `of_layer[i]` layer i's."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.of_layer: list[int] = []
        keys: list[tuple[RopeParams, int]] = []
        for t, d in zip(cfg.layer_types, cfg.head_dims):
            if (cfg.rope[t], d) not in keys:
                keys.append((cfg.rope[t], d))
                self.register_buffer(f"inv_freq_{len(keys) - 1}", cfg.rope[t].inv_freq(d), persistent=False)
            self.of_layer.append(keys.index((cfg.rope[t], d)))
        self.num = len(keys)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [RopeParams.cos_sin(getattr(self, f"inv_freq_{j}"), positions, dtype) for j in range(self.num)]


class Gemma4TextModel(nn.Module):
    def __init__(self, cfg: Gemma4Config, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, 0.0)
        p = cfg.hidden_size_per_layer_input
        if p:
            n = cfg.num_hidden_layers
            self.embed_tokens_per_layer = Embedding(cfg.vocab_size_per_layer_input, n * p, dtype)
            self.per_layer_model_projection = Linear(cfg.hidden_size, n * p, dtype)
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps, dtype, 0.0)


class Gemma4ForCausalLM(CausalLM):
    """Gemma4ForCausalLM and the text towers of Gemma4ForConditionalGeneration and gemma4_unified."""

    config_class = Gemma4Config
    stacked = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: Gemma4Config, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.model = Gemma4TextModel(cfg, dtype)
        # An untied head: a table of the embedding's shape used only as the head, so that it is quantised
        # (QuantEmbedding) and sharded over the vocabulary (tensor_parallel.py) as the tied one is.
        self.lm_head = None if cfg.tie_word_embeddings else Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        if cfg.multimodal and type(self) is Gemma4ForCausalLM:
            log.info("%s: serving the text tower only; image and audio inputs are not supported yet, their "
                     "tower weights are skipped", cfg.architecture)
        self.ropes = LayerRopes(cfg)
        shared = [i for i, src in enumerate(cfg.kv_sources) if src is not None]
        self._first_kv_shared = shared[0] if shared else cfg.num_hidden_layers

    # -- engine hooks ---------------------------------------------------------------------
    def engine_preferences(self) -> ModelPreferences:
        """V2 for this geometry (windows, 512-wide global heads, KV-less shared layers); scratch on for
        text-only checkpoints, off for multimodal ones (an image must not be split across chunks)."""
        return ModelPreferences(kv_cache_manager="v2", swa_scratch_reuse=not self.config.multimodal,
                                kv_transfer_runtime="nixl")

    def kv_layer_specs(self, dtype: torch.dtype) -> list[LayerSpec]:
        return self.config.kv_layer_specs(dtype)

    # -- forward ----------------------------------------------------------------------------
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        cfg, m = self.config, self.model
        x = inputs.inputs_embeds if inputs.inputs_embeds is not None else self.embed(inputs.input_ids)
        ple = self._per_layer_inputs(inputs.input_ids, x) if cfg.hidden_size_per_layer_input else None
        tables = self.ropes.tables(inputs.positions, x.dtype)
        of_layer = self.ropes.of_layer
        layers, attn, rows, lora = m.layers, inputs.attention, inputs.sample_rows, inputs.lora
        h = rms_norm(x, layers[0].input_layernorm.weight, layers[0].kind)
        for i, layer in enumerate(layers):
            if rows is not None and i == self._first_kv_shared:
                # From here no layer writes KV, so rows nobody samples are dead: keep only the sampled ones.
                if rows.numel() == 0:
                    return h[rows]
                x, h = x[rows], h[rows]
                ple = None if ple is None else ple[rows]
                tables = [(c[rows], s[rows]) for c, s in tables]
                lora = None if lora is None else lora.select(rows)
                attn, rows = attn.last_tokens(inputs.sample_seqs), None
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else m.norm
            x, h = layer(x, h, tables[of_layer[i]], attn, None if ple is None else ple[:, i], next_norm, lora)
        return h if rows is None else h[rows]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled token embeddings [T, H] (the scale cast to the table's dtype, as HF does)."""
        table = self.model.embed_tokens
        return table(input_ids) * torch.tensor(self.config.hidden_size ** 0.5).to(table.dtype)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: (RMSNorm(embeds @ W^T * H^-1/2) + E_ple[ids] * sqrt(P)) * 2^-1/2, as HF scales it."""
        cfg, m = self.config, self.model
        p, n = cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
        table = m.embed_tokens_per_layer
        tok = (table(input_ids) * torch.tensor(p ** 0.5).to(table.dtype)).view(-1, n, p)
        proj = m.per_layer_model_projection(embeds) * cfg.hidden_size ** -0.5
        proj = rms_norm(proj.view(-1, n, p), m.per_layer_projection_norm.weight, NormKind(cfg.rms_norm_eps, 0.0))
        return (proj + tok) * 2.0 ** -0.5

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (self.model.embed_tokens if self.lm_head is None else self.lm_head).as_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = softcap(logits, cap)
        return logits

    # -- weights ----------------------------------------------------------------------------
    _SKIPPED_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        elif name.startswith(self._SKIPPED_TOWERS):
            return None   # served text-only (logged once when the model was built)
        if name == "lm_head.weight":
            return None if self.lm_head is None else name   # tied: the embedding is the head
        parts = name.split(".")
        if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn" \
                and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"):
            layer = int(parts[2])
            if 0 <= layer < self.config.num_hidden_layers and self.config.kv_sources[layer] is not None:
                return None   # KV-shared layers never use their own k/v weights
        return name

    _GGUF_GLOBAL = {
        "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",   # an untied head (the config says so: from_gguf)
        "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
        "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
        "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    }
    _GGUF_LAYER = {
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
        "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
        "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
        "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
        "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale",
        "ffn_gate_up_exps.weight": "experts.gate_up_proj", "ffn_down_exps.weight": "experts.down_proj",
        "layer_output_scale.weight": "layer_scalar",
        "inp_gate.weight": "per_layer_input_gate.weight", "proj.weight": "per_layer_projection.weight",
        "post_norm.weight": "post_per_layer_input_norm.weight",
    }

    def gguf_name(self, name: str) -> tuple[str | None, bool]:
        """llama.cpp gemma4 tensor name -> (our name, False): Gemma 4 norms are stored as w."""
        if name == "rope_freqs.weight":
            return None, False   # proportional RoPE, already in the config
        if name in self._GGUF_GLOBAL:
            return self._GGUF_GLOBAL[name], False
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in self._GGUF_LAYER:
            raise UserInputError(f"unexpected tensor {name!r} in a gemma4 GGUF file")
        if int(parts[1]) >= self.config.num_hidden_layers:   # else the error would name our tensor, not the file's
            raise UserInputError(f"unexpected tensor {name!r} in a gemma4 GGUF file of "
                                 f"{self.config.num_hidden_layers} blocks")
        return self.checkpoint_name(f"model.layers.{parts[1]}.{self._GGUF_LAYER[parts[2]]}"), False
