"""Transfer runtimes: what moves a transfer's bytes from a prefill engine to a decode engine.

    nixl    NIXL agents (UCX backend): the decode engine READs the prefill engine's registered staging
            buffer (DRAM or VRAM), one-sided, like vLLM's and TensorRT-LLM's KV connectors
    torch   torch.distributed point-to-point: a two-rank process group per (prefill, decode) pair,
            gloo on the CPU, NCCL on CUDA

Each runtime states what it can do (`RuntimeInfo`); "auto" resolution (config/kv_transfer.py) asks
and never guesses. Both move V2's pages: the sender gathers exactly the plan's token rows (plan.py)
into a staging buffer, whatever the page layout.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

import torch



@dataclass(frozen=True)
class RuntimeInfo:
    name: str
    moves_v2_pages: bool          # can move a sliding group's window tail out of V2's shared arena
    unavailable: str | None = None   # why it cannot run here, or None


def import_nixl():
    """The NIXL Python API module: the `nixl` meta package, or a CUDA-flavoured wheel directly."""
    errors = []
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("NIXL is not installed (pip install 'gemmaserve[nixl]'): " + "; ".join(errors))


def probe(name: str, device: torch.device) -> RuntimeInfo:
    """What runtime `name` can do on `device` (imports NIXL to find out, creates nothing)."""
    if name == "nixl":
        try:
            import_nixl()
        except ImportError as exc:
            return RuntimeInfo("nixl", True, str(exc))
        return RuntimeInfo("nixl", True)
    if name == "torch":
        import torch.distributed as dist

        if not dist.is_available():
            return RuntimeInfo("torch", True, "this torch build has no torch.distributed")
        if device.type == "cuda" and not dist.is_nccl_available():
            return RuntimeInfo("torch", True, "this torch build has no NCCL")
        if device.type != "cuda" and not dist.is_gloo_available():
            return RuntimeInfo("torch", True, "this torch build has no gloo")
        return RuntimeInfo("torch", True)
    raise ValueError(f"unknown transfer runtime {name!r} (nixl or torch)")


class TransferTimeout(RuntimeError):
    """A transfer did not complete within --kv-transfer-timeout."""


Control = Callable[[str, dict], dict]   # a request to the source engine's control endpoint: (op, body) -> reply


class TransferSource(Protocol):
    """The prefill side: offers staged buffers under a transfer id until they are withdrawn."""

    def offer(self, transfer_id: str, buffer: torch.Tensor) -> dict:
        """Make `buffer` fetchable; returns what a sink needs to fetch it (JSON-friendly)."""

    def handle(self, op: str, body: dict, timeout: float) -> dict:
        """A sink's control request (two-sided runtimes: join a pair group, send a buffer)."""

    def withdraw(self, transfer_id: str) -> None: ...

    def close(self) -> None: ...


class TransferSink(Protocol):
    """The decode side: fetches a buffer a source offered."""

    def receive(self, source: dict, transfer_id: str, nbytes: int, device: torch.device, timeout: float,
                control: Control) -> torch.Tensor:
        """The offered bytes (uint8 on `device`). Raises TransferTimeout past `timeout` seconds, or
        RuntimeError when the source fails."""

    def close(self) -> None: ...
