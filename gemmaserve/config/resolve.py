"""Resolving "auto" cache options (DESIGN.md §5, seed 000).

Order: the model's config is loaded -> the model class states its preferences -> explicit user
values win -> compatibility demotions, each recorded with its reason. An explicit value that cannot
work is a clear error; an "auto" value that cannot work is demoted and logged.

    option               auto means                         needs
    kv_cache_manager     the model's preference (Gemma: v2) a backend that views a shared arena
    swa_scratch_reuse    the model's preference (text: on)  v2, a backend with scratch pages, KV-sharing
                                                            layers reading the last writer of their group
    enable_prefix_caching  on                               v2
    kv_transfer_runtime  the model's preference (Gemma: nixl) a disaggregated role; one that works here and,
                         (config/kv_transfer.py)              for v2, can move v2's pages

`batch_invariant` has no "auto" (off unless asked): `resolve_batch_invariance` checks that it can hold
here and returns what it replaces, which the engine logs.
"""

from __future__ import annotations

import enum

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..attention.base import BackendCapabilities
from ..errors import UserInputError
from ..kv.groups import derive_groups
from ..kv.spec import LayerSpec
from ..models.base import ModelPreferences
from ..transfer.runtime import RuntimeInfo
from .engine import EngineConfig
from .kv_transfer import resolve_transfer_runtime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheOptions:
    kv_cache_manager: Literal["v1", "v2"]
    swa_scratch_reuse: bool
    enable_prefix_caching: bool
    demotions: tuple[str, ...]
    kv_transfer_runtime: str | None = None   # disaggregated roles only


def resolve_cache_options(config: EngineConfig, prefs: ModelPreferences, backend: BackendCapabilities,
                          specs: list[LayerSpec], probe: Callable[[str], RuntimeInfo] | None = None) -> CacheOptions:
    """`probe(runtime name)`: what a KV transfer runtime can do here (needed for a disaggregated role)."""
    demotions: list[str] = []

    def demote(what: str, why: str) -> None:
        demotions.append(f"{what} ({why})")
        log.info("auto resolution: %s because %s", what, why)

    # 0. KV transfer runtime (disaggregated roles).
    runtime = None
    if config.kv_transfer is not None and config.kv_transfer.disaggregated:
        if probe is None:
            raise ValueError("a disaggregated role needs a transfer runtime probe")
        runtime = resolve_transfer_runtime(config.kv_transfer, prefs.kv_transfer_runtime, probe, demote)

    # 1. KV cache manager.
    manager = prefs.kv_cache_manager if config.kv_cache_manager == "auto" else config.kv_cache_manager
    if manager == "v2" and not backend.shared_arena:
        why = f"attention backend {backend.name!r} cannot read per-layer pages of a shared arena"
        if config.kv_cache_manager == "v2":
            raise UserInputError(f"--kv-cache-manager v2 is not available: {why}")
        manager = "v1"
        demote("kv_cache_manager auto -> v1", why)
    if manager == "v2" and runtime is not None and not runtime.moves_v2_pages:
        why = f"KV transfer runtime {runtime.name!r} cannot move v2's pages"
        if config.kv_cache_manager == "v2":
            raise UserInputError(f"--kv-cache-manager v2 is not available: {why}")
        manager = "v1"
        demote("kv_cache_manager auto -> v1", why)

    # 2. SWA scratch reuse.
    explicit_scratch = config.swa_scratch_reuse != "auto"
    scratch = config.swa_scratch_reuse == "on" if explicit_scratch else prefs.swa_scratch_reuse
    if scratch:
        why = _scratch_blocker(manager, backend, specs, config.page_size)
        if why is not None:
            if explicit_scratch:
                raise UserInputError(f"--swa-scratch-reuse on is not possible: {why}")
            scratch = False
            demote("swa_scratch_reuse auto -> off", why)

    # 3. Prefix caching.
    caching = True if config.enable_prefix_caching is None else config.enable_prefix_caching
    if caching and manager == "v1":
        why = "KV manager v1 keeps no content-addressed blocks"
        if config.enable_prefix_caching:
            raise UserInputError(f"--enable-prefix-caching is not available: {why}; use --kv-cache-manager v2")
        caching = False
        demote("enable_prefix_caching auto -> off", why)
    return CacheOptions(manager, scratch, caching, tuple(demotions), runtime.name if runtime else None)


def _scratch_blocker(manager: str, backend: BackendCapabilities, specs: list[LayerSpec],
                     page_size: int) -> str | None:
    """Why scratch reuse cannot run with this setup, or None. Groups depend on the page size (it
    sets each layer's tokens per page), so they are derived as the KV manager will derive them."""
    if manager != "v2":
        return "it needs KV manager v2 (v1 has no per-layer page tables)"
    if not backend.scratch_pages:
        return f"attention backend {backend.name!r} does not support scratch pages"
    groups = derive_groups(specs, page_size).groups
    last_writer = {layer: g.layers[-1] for g in groups for layer in g.layers}
    for i, s in enumerate(specs):
        if not s.owns_kv and last_writer[s.kv_source] != s.kv_source:
            return (f"layer {i} reads the KV of layer {s.kv_source}, which is not the last layer of its group, "
                    "so a later layer would overwrite that layer's scratch pages first")
    return None


# What `--batch-invariant` replaces (logged when the engine starts with it).
BATCH_INVARIANT_CHANGES = (
    "linear layers and the output head: cuBLAS -> one Triton GEMM tile configuration per (N, K), no split-K "
    "(models/invariant_kernels.py)",
    "MoE experts: torch._grouped_mm -> the same GEMM loop per expert; router and expert sums in index order",
    "decode attention: the split-K kernel (its splits follow the batch size) -> the prefill kernel with "
    "one-token tiles (attention/triton_backend.py)",
    "sampling: temperature/top-k/top-p/min-p filtering and logprobs row by row (engine/sampler.py)",
)


class BatchInvariance(enum.Enum):
    """How a request's logits come to be independent of its batch (or not)."""

    OFF = "off"           # CUDA without --batch-invariant: a row's last bits may follow its batch
    NATIVE = "native"     # the CPU's torch path: every kernel row-independent by construction, always
    KERNELS = "kernels"   # --batch-invariant: the Triton kernels below (CUDA, or Triton's interpreter)


def resolve_batch_invariance(config: EngineConfig, device_type: str, backend: BackendCapabilities,
                             quantized: bool) -> BatchInvariance:
    """How the engine is batch-invariant (`--batch-invariant`): a clear error where it cannot hold.
    `quantized`: the weights stay quantised (GGUF files; compressed-tensors or fp8 checkpoints)."""
    if device_type == "cpu" and backend.name == "torch":
        return BatchInvariance.NATIVE   # (the flag asks for nothing more there)
    if not config.batch_invariant:
        return BatchInvariance.OFF
    if not backend.batch_invariant:
        why = "" if config.attention_backend != "auto" else " (auto chose it: is Triton installed?)"
        raise UserInputError(f"--batch-invariant needs the triton attention backend; attention backend "
                             f"{backend.name!r}{why} pads a decode batch to its longest row")
    if quantized:
        raise UserInputError("--batch-invariant needs unquantised weights (--quantization none, and on the CPU "
                             "--dtype float32 for a GGUF file): there is no batch-invariant Triton kernel for "
                             "quantised weights (int4, int8, fp8)")
    if device_type == "cpu" and config.cpu_compile == "on":
        raise UserInputError("--batch-invariant cannot be combined with --cpu-compile on")
    return BatchInvariance.KERNELS
