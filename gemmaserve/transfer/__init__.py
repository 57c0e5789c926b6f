"""Moving a prompt's KV from a prefill engine to a decode engine (disaggregated serving): what moves
(plan.py), copying it out of and into the paged cache (kv_io.py), and the runtimes that carry the
bytes (runtime.py: NIXL, torch.distributed)."""

from __future__ import annotations

import torch

from .plan import LayerSpan, TransferPlan, plan_transfer
from .runtime import RuntimeInfo, TransferSink, TransferSource, TransferTimeout, probe


def make_source(name: str, device: torch.device) -> TransferSource:
    if name == "nixl":
        from .nixl_runtime import NixlSource

        return NixlSource()
    from .torch_runtime import TorchSource

    return TorchSource(device)


def make_sink(name: str, device: torch.device, host: str) -> TransferSink:
    if name == "nixl":
        from .nixl_runtime import NixlSink

        return NixlSink()
    from .torch_runtime import TorchSink

    return TorchSink(device, host)


__all__ = ["LayerSpan", "RuntimeInfo", "TransferPlan", "TransferSink", "TransferSource", "TransferTimeout",
           "make_sink", "make_source", "plan_transfer", "probe"]
