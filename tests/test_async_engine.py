"""The engine thread's idle KV integrity check runs in slices and gives way to arriving work."""

from __future__ import annotations

import time

import pytest

from gemmaserve.engine.llm import LLM
from gemmaserve.kv.manager_v2 import KVCacheManagerV2
from gemmaserve.server.async_engine import AsyncEngine
from gemmaserve.server.metrics import ServerMetrics

from helpers import fresh_seed, save_checkpoint, tiny_hf_model


def test_v2_check_comes_in_slices_and_still_catches_corruption():
    from gemmaserve.bench.shapes import SHAPES

    kv = KVCacheManagerV2(SHAPES["gemma3-1b"].layer_specs(), 16, 200_000, enable_prefix_caching=True)
    tokens = list(range(3, 5003))
    assert kv.allocate("a", tokens, 0, 5000, prefill=True)
    kv.commit("a", tokens, 5000)
    assert len(list(kv.integrity_steps())) > 1   # more than one slice for ~380 slots
    kv.pool._free.append(kv._seqs["a"].tables[1].slots[0].pages[0])
    with pytest.raises(AssertionError, match="free"):
        list(kv.integrity_steps())


def test_arriving_work_does_not_wait_for_the_idle_check(tmp_path):
    llm = LLM(model=str(save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "m")), page_size=4)
    runs = {"started": 0, "finished": 0}

    def slow_check():   # two seconds of checking, in 5 ms slices
        runs["started"] += 1
        for _ in range(400):
            time.sleep(0.005)
            yield
        runs["finished"] += 1

    llm.engine.kv.integrity_steps = slow_check
    engine = AsyncEngine(llm.engine, ServerMetrics())
    engine._checked_idle = False   # as after a request: the next idle runs the check
    engine.start()
    try:
        time.sleep(0.2)
        assert runs == {"started": 1, "finished": 0}
        t = time.perf_counter()
        engine.call_blocking(lambda eng: None)
        assert time.perf_counter() - t < 0.5   # served between slices, not after the whole check
        deadline = time.time() + 10
        while runs["finished"] == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert runs == {"started": 2, "finished": 1} and engine._integrity_ok   # started over, then passed
    finally:
        engine.shutdown()
