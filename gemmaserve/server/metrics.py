"""Prometheus metrics of one server (its own registry: two servers in a process do not mix).

Counters and histograms are updated by the engine loop as outputs appear; gauges that describe the
engine now (queue, KV pages, preemptions, prefix hits) are read from a snapshot taken on the engine
loop when /metrics is scraped, so they are consistent with each other.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.snapshot import EngineSnapshot

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None
        self.integrity_ok = True

    def collect(self):
        s = self.snapshot
        if s is None:
            return
        yield GaugeMetricFamily("gemmaserve_num_requests_waiting", "Completions queued (not admitted, or preempted)",
                                value=s.waiting)
        yield GaugeMetricFamily("gemmaserve_num_requests_running", "Completions holding KV pages", value=s.running)
        pages = GaugeMetricFamily("gemmaserve_kv_pages", "KV cache pages by state", labels=["state"])
        for state, value in (("used", s.pages_used), ("free", s.pages_free), ("cached", s.pages_cached)):
            pages.add_metric([state], value)
        yield pages
        yield GaugeMetricFamily("gemmaserve_kv_pages_total", "KV cache pages in the pool", value=s.pages_total)
        yield GaugeMetricFamily("gemmaserve_kv_scratch_pages", "Pages used as sliding-window scratch",
                                value=s.pages_scratch)
        yield CounterMetricFamily("gemmaserve_preemptions", "Completions preempted for lack of KV pages",
                                  value=s.preemptions)
        yield CounterMetricFamily("gemmaserve_prefix_cache_queried_tokens",
                                  "Prompt tokens looked up in the prefix cache",
                                  value=s.prefix_query_tokens)
        yield CounterMetricFamily("gemmaserve_prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache",
                                  value=s.prefix_hit_tokens)
        yield GaugeMetricFamily("gemmaserve_prefix_cache_hit_rate", "Hit tokens / queried tokens since start",
                                value=s.prefix_hit_rate)
        if s.tier is not None:
            t = s.tier
            yield GaugeMetricFamily("gemmaserve_kv_offload_bytes", "Host KV tier bytes holding blocks",
                                    value=t.bytes_used)
            yield GaugeMetricFamily("gemmaserve_kv_offload_capacity_bytes", "Host KV tier size",
                                    value=t.num_pages * t.page_bytes)
            yield CounterMetricFamily("gemmaserve_kv_offload_saved_blocks",
                                      "Blocks copied to the host tier as the device evicted them", value=t.saved_blocks)
            yield CounterMetricFamily("gemmaserve_kv_offload_loaded_blocks",
                                      "Blocks copied back from the host tier instead of recomputed",
                                      value=t.loaded_blocks)
            yield CounterMetricFamily("gemmaserve_kv_offload_evicted_blocks",
                                      "Blocks the host tier dropped to make room", value=t.evicted_blocks)
        for state, counts in (("running", s.lora_running), ("waiting", s.lora_waiting)):
            family = GaugeMetricFamily(f"gemmaserve_lora_requests_{state}",
                                       f"Completions {state} per LoRA adapter", labels=["adapter"])
            for name, n in counts:
                family.add_metric([name], n)
            yield family
        yield GaugeMetricFamily("gemmaserve_lora_adapters", "LoRA adapters registered (--lora-modules and loaded)",
                                value=s.lora_adapters)
        yield GaugeMetricFamily("gemmaserve_lora_max_loras", "Most LoRA adapters in one step (--max-loras)",
                                value=s.max_loras)
        yield GaugeMetricFamily("gemmaserve_kv_integrity_ok", "1 if the last idle KV integrity check passed",
                                value=1.0 if self.integrity_ok else 0.0)
        yield CounterMetricFamily("gemmaserve_spec_decode_num_drafts", "Sequence steps that carried drafted tokens",
                                  value=s.spec.steps)
        yield CounterMetricFamily("gemmaserve_spec_decode_num_draft_tokens", "Tokens drafted",
                                  value=s.spec.drafted)
        yield CounterMetricFamily("gemmaserve_spec_decode_num_accepted_tokens", "Drafted tokens the target agreed with",
                                  value=s.spec.accepted)
        per_pos = CounterMetricFamily("gemmaserve_spec_decode_num_accepted_tokens_per_pos",
                                      "Steps whose draft at this position was accepted", labels=["position"])
        for i, n in enumerate(s.spec.accepted_at):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        drafted_pos = CounterMetricFamily("gemmaserve_spec_decode_num_draft_tokens_per_pos",
                                          "Steps that drafted a token at this position", labels=["position"])
        for i, n in enumerate(s.spec.drafted_at):
            drafted_pos.add_metric([str(i)], n)
        yield drafted_pos
        yield GaugeMetricFamily("gemmaserve_spec_decode_acceptance_rate", "Accepted / drafted tokens since start",
                                value=s.spec.acceptance_rate)
        yield GaugeMetricFamily("gemmaserve_spec_decode_mean_accepted_length",
                                "Tokens a speculative step emitted on average (accepted drafts + 1)",
                                value=s.spec.mean_accepted_length)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gemmaserve_requests", "Finished completions by finish reason (abort: client left "
                                "or shutdown; timeout: deadline; error: engine failure)",
                                ["finish_reason"], registry=r)
        self.admitted = Counter("gemmaserve_requests_admitted", "Completions handed to the engine (each ends once "
                                "in gemmaserve_requests)", registry=r)
        self.http_requests = Counter("gemmaserve_http_requests", "Requests to the API routes (/v1, /tokenize, "
                                     "/detokenize), each counted once when it "
                                     "ends, by response status (none: the client left before any response)",
                                     ["status"], registry=r)
        self.http_errors = Counter("gemmaserve_http_errors", "Error responses by status code", ["status"], registry=r)
        self.prompt_tokens = Counter("gemmaserve_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("gemmaserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("gemmaserve_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("gemmaserve_inter_token_latency_seconds", "Time between generated tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("gemmaserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.engine = _EngineCollector()
        r.register(self.engine)

    def render(self, snapshot: EngineSnapshot | None, integrity_ok: bool = True) -> bytes:
        """`snapshot` None: no engine yet (loading): counters only. `integrity_ok`: what the last idle KV
        integrity check found (the server's engine thread runs it)."""
        self.engine.snapshot = snapshot
        self.engine.integrity_ok = integrity_ok
        return generate_latest(self.registry)
