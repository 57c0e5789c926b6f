"""`EngineSnapshot`: the engine's counters and gauges at one moment, as plain values (`LLMEngine.snapshot()`).

What the server's /metrics, the CLI's --verbose line and the benchmarks read, taken between steps (on the
engine thread when a server runs it), so its numbers agree with each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kv.host_tier import HostTierStats
from .scheduler import SpecStats


@dataclass(frozen=True)
class EngineSnapshot:
    waiting: int                                     # completions queued (not admitted, or preempted)
    running: int                                     # completions holding KV pages
    pages_total: int
    pages_used: int
    pages_free: int
    pages_cached: int
    pages_scratch: int
    preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    spec: SpecStats = field(default_factory=SpecStats)   # speculative decoding: a copy of the scheduler's
    tier: HostTierStats | None = None                # the host KV tier (--kv-offload-memory), if any
    # LoRA: completions per adapter name, running (holding KV pages) and waiting; adapters registered; --max-loras
    lora_running: tuple[tuple[str, int], ...] = ()
    lora_waiting: tuple[tuple[str, int], ...] = ()
    lora_adapters: int = 0
    max_loras: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
