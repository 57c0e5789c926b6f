"""`EngineInternals`: the parts an engine is assembled from, for benchmarks and tests that measure or check one
part on its own (a CUDA graph's replay, the model's forward, the KV manager's pages).

Not the engine's interface: the server, the CLI and every room under engine/ use `LLMEngine`'s methods
(add, abort, step, validate, snapshot, adapters, info); tests/test_layering.py keeps them off this view. It is
read by benchmarks in `benchmarks/` and `gemmaserve/bench/`, which time what no counter says. What it holds is
owned by the engine: reading it is fine, driving a part behind the engine's back (a step of the runner, a page
of the KV manager) leaves the engine in a state it does not know about.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..kv.base import KVCacheManager
    from ..models.loader import LoadedModel
    from .compile.compiled_steps import CompiledDecodeSteps
    from .model_runner import ModelRunner
    from .output_processor import OutputProcessor
    from .scheduler import Scheduler


@dataclass(frozen=True)
class EngineInternals:
    kv: "KVCacheManager"               # pages, prefix cache, host tier
    scheduler: "Scheduler"
    runner: "ModelRunner"              # the device cache, CUDA graphs, sampling state
    model: torch.nn.Module
    tokenizer: Any
    loaded: "LoadedModel"              # weights and their formats
    compiled_steps: "CompiledDecodeSteps"
    outputs: "OutputProcessor"
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
