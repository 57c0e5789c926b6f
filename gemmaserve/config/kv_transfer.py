"""Disaggregated serving options (`gemmaserve serve --role ...`) and the "auto" resolution of the KV
transfer runtime (seed 000's rules, DESIGN.md §5 and §8).

    role                both (default: one engine does everything), prefill, decode
    kv_transfer_runtime auto = the model's preference (Gemma: nixl); explicit values win
    rules (in order)    role both: no runtime, nothing changes
                        the runtime cannot run here: explicit -> error; auto -> the other runtime, logged
                        the runtime cannot move V2's pages: --kv-cache-manager v2 -> error; auto -> v1, logged
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UserInputError
from .options import number, option

if TYPE_CHECKING:   # the command line builds its parser from this module without importing torch
    from ..transfer.runtime import RuntimeInfo

ROLES = ("both", "prefill", "decode")
RUNTIMES = ("nixl", "torch")   # transfer/runtime.py implements them
RUNTIME_CHOICES = ("auto", *RUNTIMES)


@dataclass
class KVTransferConfig:
    role: str = option("both", choices=ROLES,
                       help="disaggregated serving: prefill computes prompts and hands their KV over, decode "
                            "receives it and generates (put `gemmaserve router` in front); both = one engine")
    kv_transfer_runtime: str = option("auto", choices=RUNTIME_CHOICES,
                                      help="what moves KV between prefill and decode engines: nixl (UCX), torch "
                                           "(torch.distributed: gloo on the CPU, NCCL on CUDA); auto = the model's "
                                           "preference (Gemma: nixl), torch where NIXL is not installed")
    kv_transfer_timeout: float = option(30.0, parse=number,
                                        help="seconds a KV transfer may take, and a staged prompt's KV waits for "
                                             "its decode engine, before it is given up and freed")
    kv_transfer_host: str | None = option(None, help="address peers reach this engine's transfer endpoints at "
                                                     "(default: --host; the machine's name when that is 0.0.0.0)")

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise UserInputError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_transfer_runtime not in RUNTIME_CHOICES:
            raise UserInputError(f"kv_transfer_runtime must be one of {', '.join(RUNTIME_CHOICES)}, "
                                 f"got {self.kv_transfer_runtime!r}")
        t = self.kv_transfer_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise UserInputError(f"kv_transfer_timeout must be a positive number of seconds, got {t!r}")

    @property
    def disaggregated(self) -> bool:
        return self.role != "both"


def resolve_transfer_runtime(config: KVTransferConfig | None, preferred: str, probe: Callable[[str], RuntimeInfo],
                             demote: Callable[[str, str], None]) -> RuntimeInfo | None:
    """The runtime an engine of this role uses (None: not disaggregated)."""
    if config is None or not config.disaggregated:
        return None
    explicit = config.kv_transfer_runtime != "auto"
    name = config.kv_transfer_runtime if explicit else preferred
    info = probe(name)
    if info.unavailable is None:
        return info
    if explicit:
        raise UserInputError(f"--kv-transfer-runtime {name} is not available: {info.unavailable}")
    other = probe(next(r for r in RUNTIMES if r != name))
    if other.unavailable is not None:
        raise UserInputError(f"no KV transfer runtime works here: {name}: {info.unavailable}; "
                             f"{other.name}: {other.unavailable}")
    demote(f"kv_transfer_runtime auto -> {other.name}", f"{name} is not available: {info.unavailable}")
    return other
