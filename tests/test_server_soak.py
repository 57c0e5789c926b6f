"""The reliability soak (gemmaserve/bench/soak.py), bounded for CI, on a tiny random model: streamed
and blocking requests, clients that leave while queued, in prefill and in decode, deadlines, bad
bodies and overload (429). Afterwards: no 5xx, no leaked page, the integrity check holds, and every
admitted completion ends exactly once in /metrics."""

from __future__ import annotations

from gemmaserve.bench.soak import SoakConfig, soak
from gemmaserve.config.engine import EngineConfig
from gemmaserve.engine.llm_engine import LLMEngine
from gemmaserve.server.background import BackgroundServer
from gemmaserve.server.config import ServerConfig

from helpers import save_checkpoint, tiny_hf_model


def test_soak_leaks_nothing_and_accounts_for_every_request(tmp_path):
    path = save_checkpoint(tiny_hf_model(77, sliding_window=8), tmp_path / "m")
    # A small KV cache and batch, so requests queue (429s) and preemption happens.
    engine = LLMEngine(EngineConfig(model=str(path), page_size=4, max_model_len=512, max_num_seqs=6,
                                    max_num_batched_tokens=128, kv_cache_memory=3 << 20))
    with BackgroundServer(engine, ServerConfig(max_queue_len=8, request_timeout=60)) as srv:
        report = soak(srv, SoakConfig(requests=240, concurrency=12, seed=5, max_tokens=16))
    print(report)
    assert report.server_errors == 0, report.statuses
    assert report.leaked_pages == 0 and report.integrity_ok
    assert report.accounted, report.mismatches
    assert set(report.faults) == {"ok", "leave_queued", "leave_prefill", "leave_decode", "leave_blocking",
                                  "deadline", "bad"}
    assert report.statuses.get("429", 0) > 0, "no overload: the soak did not test the queue bound"
    assert report.finished.get("abort", 0) > 0 and report.finished.get("timeout", 0) > 0
