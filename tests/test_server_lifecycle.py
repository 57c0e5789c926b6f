"""The server as a service behind a load balancer, on a tiny random model: readiness while loading,
a bounded queue (429 + Retry-After), deadlines that abort and free, a drain on shutdown (SIGTERM),
and an event loop that large prompts never stall."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gemmaserve.config.engine import EngineConfig
from gemmaserve.engine.llm_engine import LLMEngine
from gemmaserve.server.async_engine import AdmissionBound, QueueFull
from gemmaserve.server.background import BackgroundServer
from gemmaserve.server.config import ServerConfig

from helpers import assert_server_kv_clean, save_checkpoint, serve_process, tiny_hf_model

from gemmaserve.bench.soak import metric_value, scrape_metrics

SEED = 1234


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_checkpoint(tiny_hf_model(SEED), tmp_path_factory.mktemp("tiny") / "m")


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), page_size=4, **kw))


def _slow(engine: LLMEngine, seconds: float) -> LLMEngine:
    """Each step takes at least `seconds`, so requests stay queued or running long enough to observe."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step
    return engine


def _request(port: int, method: str, path: str, body: dict | str | None = None,
             timeout: float = 60) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps(body) if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), json.loads(raw) if raw else {}


def _metric(port: int, name: str, labels: str = "") -> float:
    return metric_value(scrape_metrics(port), name, labels)


def _request_text(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    text = conn.getresponse().read().decode()
    conn.close()
    return text


LONG = {"prompt": "abc abc abc", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


def test_health_is_503_while_the_model_loads(tiny_path):
    release = threading.Event()

    def loader() -> LLMEngine:
        release.wait(30)
        return _engine(tiny_path)

    with BackgroundServer(loader) as srv:
        status, headers, body = _request(srv.port, "GET", "/health")
        assert (status, body) == (503, {"status": "loading"})
        status, headers, body = _request(srv.port, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "server_loading" and headers["retry-after"] == "1"
        assert "gemmaserve_requests_admitted_total" in _request_text(srv.port, "/metrics")   # no engine yet: fine
        release.set()
        deadline = time.monotonic() + 30
        while _request(srv.port, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _request(srv.port, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2})[0] == 200


def test_a_full_queue_answers_429_with_retry_after(tiny_path):
    engine = _slow(_engine(tiny_path, max_num_seqs=1), 0.02)
    with BackgroundServer(engine, ServerConfig(max_queue_len=2)) as srv:
        results: list[int] = []

        def send():
            results.append(_request(srv.port, "POST", "/v1/completions", {**LONG, "max_tokens": 25})[0])

        threads = [threading.Thread(target=send) for _ in range(3)]   # one runs, two wait: the queue is full
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while srv.server.async_engine.bound.count < 3:   # one runs, two wait
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status, headers, body = _request(srv.port, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2})
        assert status == 429 and headers["retry-after"] == "1" and body["error"]["code"] == "queue_full"
        assert set(body["error"]) == {"message", "type", "param", "code"}
        for t in threads:
            t.join(60)
        assert results == [200, 200, 200]
        assert _metric(srv.port, "gemmaserve_http_errors_total", '{status="429"}') == 1
        assert_server_kv_clean(srv)


def test_the_admission_bound_counts_completions_and_takes_anything_while_nothing_waits():
    bound = AdmissionBound(slots=2, queue_len=2)
    bound.admit(5)              # nothing waits: taken whatever its size
    with pytest.raises(QueueFull, match="5 completions are running or waiting \\(at most 4"):
        bound.admit(1)
    assert bound.count == 5     # a refusal counts nothing
    bound.release(3)            # 2: both slots busy, nothing waits
    bound.admit(2)              # 4: the two queue places
    with pytest.raises(QueueFull):
        bound.admit(1)
    bound.release(1)
    bound.admit(1)
    assert bound.count == 4
    unbounded = AdmissionBound(slots=2, queue_len=None)
    for _ in range(3):
        unbounded.admit(100)


@pytest.mark.parametrize("n, accepted", [(1, 4), (2, 2)])
def test_a_burst_never_exceeds_max_num_seqs_plus_max_queue_len(tiny_path, n, accepted):
    """12 concurrent completions requests (the official client, no retries) against 2 running slots and 2
    queue places: exactly as many as fit get 200 (4 completions: 4 requests of n=1, or 2 of n=2) and
    finish, the rest get 429 with Retry-After, and the engine never holds more than 4 completions. The
    engine's first step waits until the burst has been answered (or 5 s), so none of the accepted ones
    can finish and make room while requests still arrive: the count is exact, not a race."""
    openai = pytest.importorskip("openai")
    burst, refused_expected = 12, 12 - accepted
    engine = _engine(tiny_path, max_num_seqs=2)
    answered = threading.Event()
    peak = [0]
    step = engine.step

    def gated_step():
        answered.wait(5)
        answered.set()   # the gate holds the first step only
        sched = engine._scheduler
        peak[0] = max(peak[0], len(sched.running) + len(sched.waiting))   # one scheduler request per completion
        return step()

    engine.step = gated_step
    with BackgroundServer(engine, ServerConfig(max_queue_len=2)) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        refused: list[str | None] = []
        lock = threading.Lock()

        def one(i: int):
            try:
                return client.completions.create(model=srv.server.model_name, prompt=f"abc {i}", max_tokens=128,
                                                 n=n, temperature=0, extra_body={"ignore_eos": True})
            except openai.RateLimitError as exc:
                with lock:
                    refused.append(exc.response.headers.get("retry-after"))
                    if len(refused) >= refused_expected:
                        answered.set()
                return None

        with ThreadPoolExecutor(burst) as pool:
            results = list(pool.map(one, range(burst)))
        done = [r for r in results if r is not None]
        assert (len(done), len(refused)) == (accepted, refused_expected)
        assert refused == ["1"] * refused_expected
        assert peak[0] <= 2 + 2
        for r in done:
            assert [c.finish_reason for c in r.choices] == ["length"] * n and r.usage.completion_tokens == 128 * n
        assert_server_kv_clean(srv)


def test_deadlines_abort_and_free(tiny_path):
    engine = _slow(_engine(tiny_path), 0.005)
    with BackgroundServer(engine, ServerConfig(request_timeout=30)) as srv:
        t = time.monotonic()
        status, _, body = _request(srv.port, "POST", "/v1/completions", {**LONG, "request_timeout": 0.3})
        assert status == 408 and body["error"]["code"] == "request_timeout"
        assert time.monotonic() - t < 5
        # Streamed: the stream ends with an error event in OpenAI's format.
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"messages": [{"role": "user", "content": "abc"}], "stream": True,
                                      "max_tokens": 2000, "ignore_eos": True, "request_timeout": 0.3}))
        events = [line for line in conn.getresponse().read().decode().splitlines() if line.startswith("data: ")]
        assert json.loads(events[-1][6:])["error"]["code"] == "request_timeout"
        bad = _request(srv.port, "POST", "/v1/completions", {**LONG, "request_timeout": -1})
        assert bad[0] == 400 and bad[2]["error"]["param"] == "request_timeout"
        assert_server_kv_clean(srv)
        assert _metric(srv.port, "gemmaserve_requests_total", '{finish_reason="timeout"}') == 2
    # The server's own --request-timeout applies when the request names none.
    with BackgroundServer(_slow(_engine(tiny_path), 0.005), ServerConfig(request_timeout=0.3)) as srv:
        assert _request(srv.port, "POST", "/v1/completions", LONG)[0] == 408
        assert_server_kv_clean(srv)


def _start_serve(tiny_path, *args: str) -> tuple[subprocess.Popen, int]:
    """`gemmaserve serve` on the tiny checkpoint in its own process; returns it and its port once ready."""
    proc, port = serve_process("--model", str(tiny_path), "--page-size", "4", *args)
    deadline = time.monotonic() + 120
    while _request(port, "GET", "/health")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc, port


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
    proc.stderr.close()


def test_a_2mb_prompt_does_not_stall_health(tiny_path):
    """The server runs in its own process: a client thread here must not share its GIL (tokenising
    2 MB of text takes ~2 s, and a tokenizer call that holds the GIL stalls every thread)."""
    proc, port = _start_serve(tiny_path, "--max-model-len", "256")
    try:
        big = {"prompt": "hello world " * ((2 << 20) // 12), "max_tokens": 4}   # ~2 MB of text
        done = threading.Event()
        result: list = []

        def send():
            result.append(_request(port, "POST", "/v1/completions", big, timeout=120))
            done.set()

        th = threading.Thread(target=send)
        th.start()
        worst = 0.0
        probes = 0
        while not done.is_set():
            t = time.perf_counter()
            assert _request(port, "GET", "/health")[0] == 200
            worst = max(worst, time.perf_counter() - t)
            probes += 1
            time.sleep(0.01)
        th.join()
        assert result[0][0] == 400 and result[0][2]["error"]["code"] == "context_length_exceeded"
        assert probes >= 10, f"the prompt was handled too fast to observe ({probes} probes)"
        assert worst < 0.25, f"/health took {worst:.3f}s while a 2 MB prompt was tokenised"
    finally:
        _stop(proc)


def test_drain_lets_requests_finish_then_aborts_and_stops(tiny_path):
    # The short request needs ~20 steps (well under the 5 s grace even on a loaded CI core); the long one
    # needs 2,000 steps of at least 10 ms each (20 s), so it is always still running when the grace ends.
    engine = _slow(_engine(tiny_path), 0.01)
    with BackgroundServer(engine, ServerConfig(shutdown_timeout=5.0)) as srv:
        results: list = []
        short = threading.Thread(target=lambda: results.append(
            ("short", _request(srv.port, "POST", "/v1/completions", {**LONG, "max_tokens": 20}))))
        long = threading.Thread(target=lambda: results.append(
            ("long", _request(srv.port, "POST", "/v1/completions", LONG))))
        short.start()
        long.start()
        deadline = time.monotonic() + 10
        while srv.server.in_flight < 2:   # both have arrived (a drain waits for what has arrived)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        srv.drain()
        time.sleep(0.1)
        assert _request(srv.port, "GET", "/health")[:3:2] == (503, {"status": "draining"})
        status, _, body = _request(srv.port, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "server_draining"
        short.join(30)
        long.join(30)
        got = dict(results)
        assert got["short"][0] == 200 and got["short"][2]["choices"][0]["finish_reason"] == "length"
        assert got["long"][0] == 200 and got["long"][2]["choices"][0]["finish_reason"] == "abort"
        assert srv.wait_stopped(30)
        st = engine._kv.stats()
        engine._kv.check_integrity()
        assert st.pages_used == 0


def test_sigterm_drains_and_exits_0(tiny_path):
    proc, port = _start_serve(tiny_path, "--shutdown-timeout", "1")
    try:
        result: list = []
        th = threading.Thread(target=lambda: result.append(_request(port, "POST", "/v1/completions",
                                                                    {**LONG, "max_tokens": 4000})))
        th.start()
        time.sleep(0.3)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t < 1 + 6   # the shutdown timeout, then uvicorn's own grace
        th.join(10)
        assert result and result[0][0] == 200 and result[0][2]["choices"][0]["finish_reason"] in ("abort", "length")
    finally:
        _stop(proc)
