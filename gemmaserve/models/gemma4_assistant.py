"""Gemma 4's MTP drafters (`Gemma4AssistantForCausalLM`, `Gemma4UnifiedAssistantForCausalLM`): a few Gemma 4
layers that own no KV and attend to the target's ("frozen KV"), drafting from the target's last hidden state.

    x = pre_projection([target_embed(token) ; target_hidden])         2 x backbone -> drafter width
    for each layer l (Gemma 4 layers, no PLE/MoE): q from x; K/V of the target's last non-shared layer of
        l's type, positions < p; a sliding layer reads the last W + 1 of them (transformers' mask)
    h = final_norm(x)
    logits = h @ E^T  (no soft-cap), or with ordered embeddings (small drafters): top-k of
             `num_centroids` centroid logits, then only the tokens of those centroids (`token_ordering`),
             everything else below them
    next hidden = post_projection(h)                                  drafter width -> backbone

One round drafts k tokens: the query stays at position p (the last committed token's), the hidden
state chains through post_projection and the token through the target's embedding. The target's KV is
read as it is committed: positions [0, p) (transformers' reference loop also lets a draft see the KV
of a draft the target rejected in the round before; we never do).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserInputError
from ..kv.spec import LayerSpec
from .base import CausalLM, ModelInputs, ModelPreferences
from .fused_ops import rms_norm
from .gemma4 import FULL, SLIDING, Gemma4Config, Gemma4DecoderLayer, LayerRopes, attention_params
from .layers import Embedding, Linear, RMSNorm
from .quant import _rows_dot  # noqa: F401  (defines gemmaserve::rows_dot)

ARCHITECTURES = ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")


@dataclass(frozen=True)
class AssistantConfig:
    text: Gemma4Config              # the drafter's layers (kv_sources unused: every layer reads the target)
    backbone_hidden_size: int
    ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_top_k: int = 32

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "AssistantConfig":
        arch = (cfg.get("architectures") or [None])[0]
        if cfg.get("model_type") not in ("gemma4_assistant", "gemma4_unified_assistant") and arch not in ARCHITECTURES:
            raise UserInputError(f"not a Gemma 4 MTP drafter: model_type {cfg.get('model_type')!r}, architecture "
                                 f"{arch!r} (expected one of {', '.join(ARCHITECTURES)})")
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise UserInputError("the drafter's config.json has no text_config")
        n = int(text.get("num_hidden_layers", 0))
        if text.get("num_kv_shared_layers") not in (None, 0, n):
            raise UserInputError(f"every layer of a Gemma 4 drafter reads the target's KV: num_kv_shared_layers "
                                 f"is {text.get('num_kv_shared_layers')}, expected {n}")
        for key, value in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False),
                           ("use_double_wide_mlp", False)):
            if text.get(key, value) not in (value, None):
                raise UserInputError(f"a Gemma 4 drafter has {key} = {value!r}, got {text[key]!r}")
        # Parsed as a plain stack (no layer of its own stores KV; `reads` below says whose it reads).
        layers = Gemma4Config.from_hf({**text, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0})
        if cfg.get("tie_word_embeddings", True) is not True:   # the drafter's own config governs (transformers)
            raise UserInputError("a Gemma 4 drafter with an untied output head (tie_word_embeddings: false) is not "
                                 "supported: its head is its embedding table (lm_head.weight and "
                                 "model.embed_tokens.weight fill the one table)")
        ordered = bool(cfg.get("use_ordered_embeddings", False))
        centroids, top_k = int(cfg.get("num_centroids", 2048)), int(cfg.get("centroid_intermediate_top_k", 32))
        if ordered and (centroids < 1 or layers.vocab_size % centroids or not 0 < top_k <= centroids):
            raise UserInputError(f"ordered embeddings need num_centroids dividing the vocabulary "
                                 f"({layers.vocab_size}) and 0 < centroid_intermediate_top_k <= num_centroids; "
                                 f"got {centroids} and {top_k}")
        return cls(layers, int(cfg.get("backbone_hidden_size", 1536)), ordered, centroids, top_k)

    def reads(self, target: Gemma4Config) -> tuple[int, ...]:
        """Per drafter layer, the target layer whose KV it reads: the last layer of its type that
        stores KV. Refuses a target the drafter was not made for."""
        t = self.text
        if t.vocab_size != target.vocab_size:
            raise UserInputError(f"the drafter's vocabulary ({t.vocab_size}) is not the target's ({target.vocab_size})")
        if self.backbone_hidden_size != target.hidden_size:
            raise UserInputError(f"the drafter was made for a target of hidden size {self.backbone_hidden_size}, "
                                 f"this one has {target.hidden_size}")
        stores = {kind: max(i for i, (k, src) in enumerate(zip(target.layer_types, target.kv_sources))
                            if k == kind and src is None)
                  for kind in set(target.layer_types)}
        out = []
        for i, kind in enumerate(t.layer_types):
            if kind not in stores:
                raise UserInputError(f"drafter layer {i} is {kind} but the target has no such layer")
            src = stores[kind]
            if (t.head_dims[i], t.kv_heads[i]) != (target.head_dims[src], target.kv_heads[src]):
                raise UserInputError(f"drafter layer {i} expects KV of {t.kv_heads[i]} heads x {t.head_dims[i]}, "
                                     f"target layer {src} has {target.kv_heads[src]} x {target.head_dims[src]}")
            out.append(src)
        return tuple(out)

    def lookback(self, target: Gemma4Config) -> int:
        """Keys behind a sequence's next query that the target's sliding groups must keep for the drafter:
        it reads W' + 1 keys ending one before that query (W' its window)."""
        if SLIDING not in self.text.layer_types:
            return 0
        return max(0, self.text.sliding_window + 2 - target.sliding_window)


class Gemma4Assistant(CausalLM):
    """The drafter. `forward(inputs)`: `inputs.inputs_embeds` is [B, 2 x backbone] (target embedding of the
    token ; target hidden state), `inputs.positions` the committed length p of each sequence, and
    `inputs.attention` a batch of one query per sequence over its p committed keys. Returns h (normed)."""

    config_class = AssistantConfig
    stacked = {"q_proj": ("qkv_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: AssistantConfig, reads: tuple[int, ...], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        t = cfg.text
        if len(reads) != t.num_hidden_layers:
            raise ValueError(f"{len(reads)} target layers for {t.num_hidden_layers} drafter layers")
        layers = []
        for i, src in enumerate(reads):
            # Keys (p - W - 2, p - 1]: a causal window of W + 1 for a query placed on key p - 1 (RoPE uses p).
            window = None if t.layer_types[i] == FULL else t.sliding_window + 1
            p = dataclasses.replace(attention_params(t, i), layer=src, owns_kv=False, window=window,
                                    image_bidirectional=False)
            layers.append(Gemma4DecoderLayer(t, i, dtype, attention=p))
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(t.hidden_size, t.rms_norm_eps, dtype, 0.0)
        self.model.embed_tokens = Embedding(t.vocab_size, t.hidden_size, dtype)   # the output head (tied)
        self.pre_projection = Linear(2 * cfg.backbone_hidden_size, t.hidden_size, dtype)
        self.post_projection = Linear(t.hidden_size, cfg.backbone_hidden_size, dtype)
        self.ropes = LayerRopes(t)
        if cfg.ordered_embeddings:
            self.masked_embedding = nn.Module()
            self.masked_embedding.centroids = Linear(t.hidden_size, cfg.num_centroids, dtype)
            self.masked_embedding.token_ordering = nn.Parameter(torch.zeros(t.vocab_size, dtype=torch.long),
                                                                requires_grad=False)

    # -- CausalLM interface (the drafter owns no KV and is never the engine's model) -------------
    @property
    def vocab_size(self) -> int:
        return self.config.text.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.config.text.max_position_embeddings

    def kv_layer_specs(self, dtype: torch.dtype) -> list[LayerSpec]:
        return []

    def engine_preferences(self) -> ModelPreferences:
        return ModelPreferences()

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        layers, m = self.model.layers, self.model
        x = self.pre_projection(inputs.inputs_embeds)
        tables = self.ropes.tables(inputs.positions, x.dtype)
        h = rms_norm(x, layers[0].input_layernorm.weight, layers[0].kind)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else m.norm
            x, h = layer(x, h, tables[self.ropes.of_layer[i]], inputs.attention, None, next_norm)
        return h

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden state the next draft of the round starts from (backbone width)."""
        return self.post_projection(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, V] as transformers has them; with ordered embeddings the tokens outside the top centroids
        sit 1 below the row's smallest computed logit (transformers: the whole batch's)."""
        head = self.model.embed_tokens
        if not self.config.ordered_embeddings:
            return head.as_head(hidden)
        tokens, logits = self._centroid_logits(hidden)
        out = (logits.min(dim=-1, keepdim=True).values - 1.0).expand(-1, self.vocab_size).clone()
        return out.scatter_(1, tokens, logits)

    def draft(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft of each row [B] (argmax of `compute_logits`, without the full-vocabulary
        scatter where the head is ordered)."""
        if not self.config.ordered_embeddings:
            return self.model.embed_tokens.as_head(hidden).argmax(dim=-1)
        tokens, logits = self._centroid_logits(hidden)
        return tokens.gather(1, logits.argmax(dim=-1, keepdim=True)).squeeze(1)

    def _centroid_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, logits), each [B, top_k * V / num_centroids]: the tokens of each row's top centroids."""
        cfg, me = self.config, self.masked_embedding
        top = me.centroids(hidden).topk(cfg.centroid_top_k, dim=-1).indices              # [B, k]
        per = me.token_ordering.view(cfg.num_centroids, -1)                                # [C, V / C]
        tokens = per[top].flatten(1)                                                       # [B, k * V / C]
        rows = self.model.embed_tokens.weight[tokens]                                      # [B, n, H]
        if hidden.device.type == "cpu":   # each row's products in their own order (cpu_products.py)
            logits = torch.ops.gemmaserve.rows_dot(hidden.float(), rows.float()).to(hidden.dtype)
        else:
            logits = torch.bmm(rows.to(hidden.dtype), hidden.unsqueeze(-1)).squeeze(-1)
        return tokens, logits

    # -- weights ------------------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        if name == "lm_head.weight":
            return "model.embed_tokens.weight"   # tied: either name fills the one table
        parts = name.split(".")
        if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn" \
                and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"):
            return None   # never used: every layer reads the target's KV (transformers skips them too)
        return name


def load_assistant(path: str | Path, target: Gemma4Config, dtype: torch.dtype,
                   device: torch.device) -> Gemma4Assistant:
    """A drafter from a Hugging Face directory (config.json + *.safetensors), checked against `target`."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserInputError(f"MTP drafter {str(path)!r}: no config.json there (give the drafter's directory)")
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{path / 'config.json'} is not valid JSON: {exc}") from None
    cfg = AssistantConfig.from_hf(raw)
    model = Gemma4Assistant(cfg, cfg.reads(target), dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserInputError(f"MTP drafter {str(path)!r} has no *.safetensors files")

    def tensors():
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as fh:
                    for raw_name in fh.keys():
                        name = model.checkpoint_name(raw_name)
                        if name is not None:
                            t = fh.get_tensor(raw_name)
                            yield name, t if name.endswith("token_ordering") else t.to(dtype)
            except (SafetensorError, OSError) as exc:   # a damaged or truncated file
                raise UserInputError(f"cannot read {file}: {exc}") from None

    model.load_weights(tensors())
    if cfg.ordered_embeddings:
        order = model.masked_embedding.token_ordering
        if not torch.equal(order.sort().values, torch.arange(cfg.text.vocab_size)):
            raise UserInputError(f"MTP drafter {str(path)!r}: token_ordering is not a permutation of the vocabulary")
    return model.to(device).eval()
