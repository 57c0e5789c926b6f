"""Gemma 3 text model (Gemma3ForCausalLM, and the text tower of Gemma3ForConditionalGeneration).

    x = E[ids] * sqrt(H)  (scale cast to the weight dtype)
    for each layer:  x += post_attn_norm(attn(in_norm(x)));  x += post_ffw_norm(mlp(pre_ffw_norm(x)))
    logits = final_norm(x) @ E^T

Attention: q/k RMSNorm, then RoPE (sliding layers: local theta; full layers: global theta with
linear scaling), scores scaled by query_pre_attn_scalar^-1/2, sliding layers see the last W tokens.
The model knows nothing of pages: it hands q/k/v to the `BatchAttention` in its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import UserInputError
from ..kv.spec import AttentionKind, LayerSpec
from .base import CausalLM, ModelInputs, ModelPreferences
from .fused_ops import NormKind, add_rms_norm, rms_norm
from .layers import Attention, AttentionParams, Embedding, GeGLU, RMSNorm, RopeParams, softcap

if TYPE_CHECKING:
    from .lora import LoRABatch

_FULL = "full_attention"
_SLIDING = "sliding_attention"


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    query_pre_attn_scalar: float
    rope_global: RopeParams
    rope_local: RopeParams
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    final_logit_softcapping: float | None = None
    multimodal: bool = False   # the checkpoint has a vision tower
    image_bidirectional: bool = False   # an image's tokens see each other on every layer (multimodal model)
    tie_word_embeddings: bool = True    # false: the output head is the checkpoint's lm_head.weight

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise UserInputError(
                f"config lists {len(self.layer_types)} layer_types for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {_FULL, _SLIDING}
        if unknown:
            raise UserInputError(f"unsupported layer types {sorted(unknown)} (expected {_FULL!r} or {_SLIDING!r})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserInputError("num_attention_heads must be a multiple of num_key_value_heads")

    def kv_layer_specs(self, dtype: torch.dtype) -> list[LayerSpec]:
        """What the KV cache needs of each layer (no weights needed: benchmarks size real shapes)."""
        return [
            LayerSpec(kind=AttentionKind.SLIDING if t == _SLIDING else AttentionKind.FULL,
                      num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim, dtype=dtype,
                      window=self.sliding_window if t == _SLIDING else None)
            for t in self.layer_types
        ]

    # -- parsing --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Gemma3Config":
        """From a Hugging Face config.json (Gemma3ForCausalLM, or the text_config of the multimodal model)."""
        multimodal = "vision_config" in cfg
        # the head's tie is the outer config's (transformers reads the model's own config, the composite one)
        tie = cfg.get("tie_word_embeddings", True)
        if not isinstance(tie, bool):
            raise UserInputError(f"config tie_word_embeddings must be true or false, got {tie!r}")
        if "text_config" in cfg and isinstance(cfg["text_config"], dict):
            cfg = cfg["text_config"]
        if cfg.get("use_bidirectional_attention"):
            raise UserInputError("bidirectional (embedding) Gemma 3 models are not supported for generation")
        if cfg.get("attn_logit_softcapping") is not None:
            raise UserInputError("attention soft-capping is not supported (Gemma 3 does not use it)")
        n_layers = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
            layer_types = [_FULL if (i + 1) % pattern == 0 else _SLIDING for i in range(n_layers)]
        hidden = cfg["hidden_size"]
        heads = cfg.get("num_attention_heads", 8)
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_global, rope_local = _rope_from_hf(cfg)
        return cls(
            vocab_size=cfg.get("vocab_size", 262208),
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            layer_types=tuple(layer_types),
            sliding_window=cfg.get("sliding_window", 4096),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
            rope_global=rope_global,
            rope_local=rope_local,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 131072),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            multimodal=multimodal,
            tie_word_embeddings=tie,
        )

    @classmethod
    def from_gguf(cls, gguf) -> "Gemma3Config":
        """From llama.cpp's gemma3 metadata. GGUF omits what llama.cpp hard-codes for Gemma 3: a
        full-attention layer every 6th, local RoPE theta 1e4, and query_pre_attn_scalar = head_dim
        except on the 27B shape (hidden 5376, 32 heads), where it is hidden / heads = 168."""
        def key(name: str, default: Any = None) -> Any:
            value = gguf.get(f"gemma3.{name}", default)
            if value is None:
                raise UserInputError(f"GGUF file lacks gemma3.{name}")
            return value

        n_layers = int(key("block_count"))
        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden // heads))
        scale_key = gguf.get("gemma3.attention.scale")
        if scale_key is not None:
            qpas = float(scale_key) ** -2
        elif hidden == 5376 and heads == 32:
            qpas = hidden // heads
        else:
            qpas = head_dim
        factor = 1.0
        if gguf.get("gemma3.rope.scaling.type") == "linear":
            factor = float(gguf.get("gemma3.rope.scaling.factor", 1.0))
        embed = gguf.tensors_by_name().get("token_embd.weight")
        vocab = embed.shape[0] if embed is not None else len(gguf.strings("tokenizer.ggml.tokens"))
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            layer_types=tuple(_FULL if (i + 1) % 6 == 0 else _SLIDING for i in range(n_layers)),
            sliding_window=int(key("attention.sliding_window")),
            query_pre_attn_scalar=qpas,
            rope_global=RopeParams(float(key("rope.freq_base", 1e6)), factor),
            rope_local=RopeParams(10_000.0),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(key("context_length", 131072)),
            tie_word_embeddings="output.weight" not in gguf.tensors_by_name(),   # llama.cpp: else token_embd
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent transformers Gemma3TextConfig arguments (used by tests and benchmarks)."""
        rope = {_FULL: self.rope_global.to_hf(), _SLIDING: self.rope_local.to_hf()}
        return dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            layer_types=list(self.layer_types), sliding_window=self.sliding_window,
            query_pre_attn_scalar=self.query_pre_attn_scalar, rope_parameters=rope,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            final_logit_softcapping=self.final_logit_softcapping, attn_logit_softcapping=None,
            tie_word_embeddings=self.tie_word_embeddings,
        )


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[RopeParams, RopeParams]:
    """Global and local RoPE from either the transformers>=5 `rope_parameters` dict or the
    older `rope_theta` / `rope_local_base_freq` / `rope_scaling` fields."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and _FULL in params:
        full, local = params[_FULL], params.get(_SLIDING, {})
        scaling = full
        theta_g = full.get("rope_theta", 1e6)
        theta_l = local.get("rope_theta", 1e4)
        if local.get("rope_type", "default") != "default":
            raise UserInputError(f"unsupported RoPE type {local['rope_type']!r} on sliding layers")
    else:
        scaling = cfg.get("rope_scaling") or {}
        theta_g = cfg.get("rope_theta", 1e6)
        theta_l = cfg.get("rope_local_base_freq", 1e4)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        factor = float(scaling["factor"])
    elif rope_type == "default":
        factor = 1.0
    else:
        raise UserInputError(f"unsupported RoPE type {rope_type!r} (Gemma 3 uses 'default' or 'linear')")
    return RopeParams(float(theta_g), factor), RopeParams(float(theta_l))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer: int, dtype: torch.dtype):
        super().__init__()
        self.is_sliding = cfg.layer_types[layer] == _SLIDING
        norm = NormKind(cfg.rms_norm_eps, 1.0)
        self.self_attn = Attention(AttentionParams(
            layer=layer, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, scale=cfg.query_pre_attn_scalar ** -0.5,
            window=cfg.sliding_window if self.is_sliding else None, norm=norm,
            image_bidirectional=cfg.image_bidirectional), dtype)
        self.mlp = GeGLU(cfg.hidden_size, cfg.intermediate_size, dtype)
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dtype)

    def forward(self, residual: torch.Tensor, h: torch.Tensor, cos_sin, attn,
                next_norm: RMSNorm, lora: LoRABatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, its input-normed copy h) -> the same for the next layer (`next_norm` is
        the next layer's input norm, or the final norm): each residual add is fused with the norm
        that follows it."""
        kind = self.input_layernorm.kind
        residual, h = add_rms_norm(residual, self.self_attn(h, cos_sin, attn, lora),
                                   self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight, kind)
        return add_rms_norm(residual, self.mlp(h, lora), self.post_feedforward_layernorm.weight, next_norm.weight,
                            kind)


class Gemma3TextModel(nn.Module):
    def __init__(self, cfg: Gemma3Config, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Gemma3ForCausalLM(CausalLM):
    """Gemma3ForCausalLM, and the text tower of Gemma3ForConditionalGeneration."""

    config_class = Gemma3Config
    stacked = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: Gemma3Config, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.model = Gemma3TextModel(cfg, dtype)
        # fp32 RoPE frequencies; the model is never cast with .to(dtype), so they stay fp32.
        self.register_buffer("_inv_freq_global", cfg.rope_global.inv_freq(cfg.head_dim), persistent=False)
        self.register_buffer("_inv_freq_local", cfg.rope_local.inv_freq(cfg.head_dim), persistent=False)
        # An untied head: a table of the embedding's shape used only as the head, so that it is quantised
        # (QuantEmbedding) and sharded over the vocabulary (tensor_parallel.py) as the tied one is.
        self.lm_head = None if cfg.tie_word_embeddings else Embedding(cfg.vocab_size, cfg.hidden_size, dtype)

    # -- engine hooks ---------------------------------------------------------------------
    def engine_preferences(self) -> ModelPreferences:
        """Gemma 3 prefers the sliding-window-aware KV manager; scratch reuse is on for text-only
        checkpoints (an image must never be split across prefill chunks, so multimodal keeps it off)."""
        return ModelPreferences(kv_cache_manager="v2", swa_scratch_reuse=not self.config.multimodal,
                                kv_transfer_runtime="nixl")

    def kv_layer_specs(self, dtype: torch.dtype) -> list[LayerSpec]:
        return self.config.kv_layer_specs(dtype)

    # -- forward ----------------------------------------------------------------------------
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Token rows [T] -> final-normed hidden states [T, H]."""
        embed = self.model.embed_tokens
        if inputs.inputs_embeds is not None:
            x = inputs.inputs_embeds
        else:
            scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32).to(embed.dtype)
            x = self.model.embed_tokens(inputs.input_ids) * scale
        dtype, positions = x.dtype, inputs.positions
        rope_global = RopeParams.cos_sin(self._inv_freq_global, positions, dtype)
        rope_local = RopeParams.cos_sin(self._inv_freq_local, positions, dtype)
        layers = self.model.layers
        h = rms_norm(x, layers[0].input_layernorm.weight, layers[0].input_layernorm.kind)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = layer(x, h, rope_local if layer.is_sliding else rope_global, inputs.attention, next_norm,
                         inputs.lora)
        return h if inputs.sample_rows is None else h[inputs.sample_rows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (self.model.embed_tokens if self.lm_head is None else self.lm_head).as_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = softcap(logits, cap)
        return logits

    # -- weights ----------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name to ours (HF naming), or None to skip it (vision tower)."""
        for prefix in ("model.language_model.", "language_model.model."):
            if name.startswith(prefix):
                return "model." + name[len(prefix):]
        if name.startswith(("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                            "model.multi_modal_projector.")):
            return None
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            return None if self.lm_head is None else "lm_head.weight"   # tied: the embedding is the head
        return name

    def gguf_name(self, name: str) -> tuple[str, bool]:
        """llama.cpp tensor name -> (our name, stored as 1+w norm)."""
        if name == "token_embd.weight":
            return "model.embed_tokens.weight", False
        if name == "output_norm.weight":
            return "model.norm.weight", True
        if name == "output.weight":   # an untied head (the config says so: from_gguf)
            return "lm_head.weight", False
        if not name.startswith("blk."):
            raise UserInputError(f"unexpected tensor {name!r} in a gemma3 GGUF file")
        _, layer, rest = name.split(".", 2)
        table = {
            "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
            "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
            "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
            "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
            "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
            "ffn_down.weight": "mlp.down_proj.weight",
        }
        if rest not in table:
            raise UserInputError(f"unexpected tensor {name!r} in a gemma3 GGUF file")
        return f"model.layers.{layer}.{table[rest]}", rest.endswith("norm.weight")
