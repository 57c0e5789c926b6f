"""The engine thread's idle KV integrity check runs in slices and gives way to arriving work."""

from __future__ import annotations

import threading
import time

import pytest

from gemmaserve.engine.llm import LLM
from gemmaserve.kv.manager_v2 import KVCacheManagerV2
from gemmaserve.server.async_engine import AsyncEngine
from gemmaserve.server.metrics import ServerMetrics

from helpers import fresh_seed, save_checkpoint, tiny_hf_model


def test_v2_check_comes_in_slices_and_still_catches_corruption():
    from gemmaserve.testing.shapes import SHAPES

    kv = KVCacheManagerV2(SHAPES["gemma3-1b"].layer_specs(), 16, 200_000, enable_prefix_caching=True)
    tokens = list(range(3, 5003))
    assert kv.allocate("a", tokens, 0, 5000, prefill=True)
    kv.commit("a", tokens, 5000)
    assert len(list(kv.integrity_steps())) > 1   # more than one slice for ~380 slots
    kv.pool._free.append(kv._seqs["a"].tables[1].slots[0].pages[0])
    with pytest.raises(AssertionError, match="free"):
        list(kv.integrity_steps())


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    """A liveness bound (a hung engine fails the test), not a speed limit."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_arriving_work_does_not_wait_for_the_idle_check(tmp_path):
    """By order of events, not seconds: the idle check below never ends until the test releases it, so a
    command that runs at all runs between its slices; then the check starts over and passes."""
    llm = LLM(model=str(save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "m")), page_size=4)
    runs = {"started": 0, "slices": 0, "finished": 0}
    release = threading.Event()

    def endless_check():   # 5 ms slices until released
        runs["started"] += 1
        while not release.is_set():
            time.sleep(0.005)
            runs["slices"] += 1
            yield
        runs["finished"] += 1

    llm.engine._kv.integrity_steps = endless_check
    engine = AsyncEngine(llm.engine, ServerMetrics())
    engine._checked_idle = False   # as after a request: the next idle runs the check
    engine.start()
    try:
        _wait_for(lambda: runs["slices"] > 0, "the idle check to start")
        seen = engine.call_blocking(lambda eng: dict(runs), timeout=30)
        assert seen["started"] == 1 and seen["finished"] == 0 and seen["slices"] > 0, seen   # served mid-check
        _wait_for(lambda: runs["started"] == 2, "the check to start over after the command")
        assert runs["finished"] == 0
        release.set()
        _wait_for(lambda: runs["finished"] == 1, "the check to pass")
        assert runs["started"] == 2 and engine.integrity_ok
    finally:
        release.set()
        engine.shutdown()
