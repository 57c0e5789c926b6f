"""Building the runner's drafters from the speculative config, checked against the target: a draft model's
weights (its vocabulary and tokenizer must be the target's) and Gemma 4's MTP assistant. Each tensor-parallel
rank builds its own (engine/executor/tp_worker.py), as rank 0 does (factory.py)."""

from __future__ import annotations

import logging
import time

import torch

from ...attention.base import AttentionBackend
from ...config.engine import EngineConfig
from ...errors import UserInputError
from ...models.gemma4 import Gemma4Config
from ...models.gemma4_assistant import load_assistant
from ...models.hub import HubOptions
from ...models.loader import LoadedModel, load_model
from ...models.tensor_parallel import shard_attention_heads
from .mtp import MtpDrafter

log = logging.getLogger(__name__)


def mtp_drafter(config: EngineConfig, model, backend: AttentionBackend, dtype: torch.dtype,
                device: torch.device) -> MtpDrafter | None:
    """The runner's drafter for `--speculative-config '{"method": "mtp", ...}'`, checked against the target.
    Under tensor parallelism (`model` a rank's shard: every rank builds its own) its attention keeps the
    heads that read this rank's KV heads."""
    spec = config.speculative_config
    if spec is None or spec.method != "mtp":
        return None
    target = model.config if isinstance(model.config, Gemma4Config) else getattr(model.config, "text", None)
    if not isinstance(target, Gemma4Config):
        raise UserInputError(f"MTP drafters exist for Gemma 4 targets only; {config.model!r} is "
                             f"{type(model).__name__} (use \"ngram\")")
    started = time.perf_counter()
    assistant = load_assistant(spec.model, target, dtype, device)
    plan = getattr(model, "tensor_parallel_plan", None)
    if plan is not None and plan.shard.world_size > 1:
        shard_attention_heads(assistant, plan.shard)
    log.info("MTP drafter %s: %d layers of width %d reading target layers %s, loaded in %.2f s", spec.model,
             assistant.config.text.num_hidden_layers, assistant.config.text.hidden_size,
             sorted(set(l.self_attn.p.layer for l in assistant.model.layers)), time.perf_counter() - started)
    return MtpDrafter(assistant, model, backend, lookback=assistant.config.lookback(target))


def draft_model(config: EngineConfig, target: LoadedModel, dtype: torch.dtype,
                device: torch.device) -> LoadedModel | None:
    """The draft model of `--speculative-config '{"method": "draft_model", ...}'`, checked against the
    target: its vocabulary must be the target's (or its first part: a multimodal target adds image ids).
    Under tensor parallelism it is split like the target (`target` a rank's shard: every rank loads its own)."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    plan = getattr(target.model, "tensor_parallel_plan", None)
    try:
        draft = load_model(spec.model, dtype, device, config.quantized_weights(device),
                           shard=plan.shard if plan is not None else None,
                           hub=HubOptions(token=config.hf_token, download_dir=config.download_dir))
    except UserInputError as exc:   # the loader names the model, not which one of the two it is
        raise UserInputError(f"speculative config: draft model: {exc}") from None
    ours, theirs = target.tokenizer, draft.tokenizer
    n = draft.model.vocab_size
    if n > target.model.vocab_size:
        raise UserInputError(f"draft model {spec.model!r} has a vocabulary of {n} tokens, more than the target's "
                             f"{target.model.vocab_size}: it must draft with the target's tokens")
    sample = list(range(0, min(n, ours.vocab_size, theirs.vocab_size), 997))
    if (ours.eos_token_id, ours.bos_token_id) != (theirs.eos_token_id, theirs.bos_token_id) or any(
            ours.decode([i], skip_special_tokens=False) != theirs.decode([i], skip_special_tokens=False) for i in sample):
        raise UserInputError(f"draft model {spec.model!r} does not use the target's tokenizer")
    log.info("draft model %s: %s, %d layers, loaded in %.2f s", spec.model, type(draft.model).__name__,
             len(draft.model.kv_layer_specs(dtype)), draft.load_seconds)
    return draft
