"""Where the model runs: the layer between the engine and its model runner(s).

    LLMEngine --StepPlan--> runner = executor.create_runner(...)
        InProcessExecutor   one ModelRunner in this process                   (tensor_parallel_size 1)
        MultiprocExecutor   rank 0's ModelRunner here + one worker process     (tensor_parallel_size N)
                            per other rank, each running every plan too         engine/executor/multiproc.py

The engine asks its executor to load the model (a rank loads its shard), to say what one device's
KV cache holds per layer (`local_kv_specs`: a rank stores only its KV heads, so pages and budgets are
per-rank bytes) and to build the runner; it then drives that runner (`apply`, `launch`, `execute`)
the same way whichever executor built it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ...attention.base import AttentionBackend
from ...config.engine import EngineConfig
from ...kv.spec import LayerSpec
from ...models.loader import LoadedModel, load_model
from ..model_runner import ModelRunner, PendingStep, RunnerKV, RunnerOptions
from ..spec_decode.drafters import Drafter
from ..step import StepPlan, StepResult
from ..structured.structured_output import Grammars


class StepRunner(Protocol):
    """What the engine calls on a runner (ModelRunner's interface)."""

    graphs: Any

    def apply(self, plan: StepPlan) -> None: ...

    def launch(self, plan: StepPlan, only: list[int] | None = None) -> PendingStep: ...

    def execute(self, plan: StepPlan, only: list[int] | None = None) -> StepResult: ...


class Executor(Protocol):
    def load_model(self, dtype: torch.dtype, device: torch.device) -> LoadedModel: ...

    def local_kv_specs(self, specs: list[LayerSpec]) -> list[LayerSpec]: ...

    def create_runner(self, model: nn.Module, backend: AttentionBackend, device: torch.device, kv: RunnerKV,
                      options: RunnerOptions, grammars: Grammars | None, drafter: Drafter | None) -> StepRunner:
        """ModelRunner's arguments (the rank's own model shard, backend, grammars and drafter; the KV layout
        and options are every rank's)."""

    def shutdown(self) -> None: ...


@dataclass
class InProcessExecutor:
    config: EngineConfig

    def load_model(self, dtype: torch.dtype, device: torch.device) -> LoadedModel:
        return load_model(self.config.model, dtype, device, self.config.quantized_weights(device),
                          quantization=self.config.quantization, mmproj=self.config.mmproj,
                          hub=self.config.hub_options())

    def local_kv_specs(self, specs: list[LayerSpec]) -> list[LayerSpec]:
        return specs

    def create_runner(self, model: nn.Module, backend: AttentionBackend, device: torch.device, kv: RunnerKV,
                      options: RunnerOptions, grammars: Grammars | None, drafter: Drafter | None) -> ModelRunner:
        return ModelRunner(model, backend, device, kv, options, grammars, drafter)

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig) -> Executor:
    """Tensor parallelism starts its workers here (they load their shards while this process loads
    rank 0's)."""
    if config.tensor_parallel_size == 1:
        return InProcessExecutor(config)
    from .multiproc import MultiprocExecutor

    return MultiprocExecutor.start(config)
