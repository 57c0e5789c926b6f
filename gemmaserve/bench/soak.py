"""`gemmaserve bench soak`: the reliability soak of the HTTP server (issue 14).

A seeded random mix of requests runs against the real server on loopback (`BackgroundServer`), with
`--concurrency` clients over raw HTTP/1.1 (so a client can leave at any byte):
    ok           completions and chats, streamed or not, n = 1 or 2, to the end
    leave        the client disconnects: while queued (at once), in prefill (a long prompt, a few ms
                 in), in decode (after a few streamed events, or a blocking request after a while)
    deadline     a `request_timeout` of 20-300 ms on a long generation (408 or an error event)
    bad          an invalid body (400)
and overload from the concurrency itself: with `--max-queue-len` small, bursts get 429.
Afterwards, with the engine idle: no KV page held by a request, the integrity check passes, no 5xx
was seen, and the books balance: every completion admitted ends exactly once in
gemmaserve_requests_total (whatever its finish reason), and the 400s, 408s and 429s the clients saw
are the ones /metrics counted (gemmaserve_http_requests_total counts each request once, by status).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import random
import re
import time
from datetime import datetime, timezone
from pathlib import Path

from ..config.options import from_namespace, positive_int

FAULTS = ("ok", "leave_queued", "leave_prefill", "leave_decode", "leave_blocking", "deadline", "bad")
WEIGHTS = (40, 10, 8, 12, 8, 12, 10)
WORDS = "river mill harbour stone bread lamp field winter road garden letter market silver clock".split()


@dataclasses.dataclass
class SoakConfig:
    requests: int = 400
    concurrency: int = 24
    seed: int = 0
    max_tokens: int = 24


@dataclasses.dataclass
class SoakReport:
    requests: int
    faults: dict[str, int]            # requests per kind (ok included)
    statuses: dict[str, int]          # HTTP status seen by clients ("none": left before the status line)
    server_errors: int                # 5xx responses or 5xx error events
    admitted: int                     # completions the engine took (gemmaserve_requests_admitted_total)
    finished: dict[str, int]          # gemmaserve_requests_total by finish reason
    leaked_pages: int                 # pages still used with no request running
    integrity_ok: bool
    accounted: bool                   # each request counted once by status; admitted == sum(finished); 408s
    http_counted: dict[str, int]      # gemmaserve_http_requests_total by status
    mismatches: list[str]
    seconds: float

    @property
    def faults_injected(self) -> int:
        return self.requests - self.faults.get("ok", 0)


@dataclasses.dataclass
class _Outcome:
    status: int | None
    error_status: int | None = None   # an error event inside a 200 stream


async def _exchange(port: int, path: str, body: dict, *, leave_after_s: float | None = None,
                    leave_after_events: int | None = None, timeout: float = 120.0) -> _Outcome:
    """One request on its own connection; leave early if told to. Returns what the client saw."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    try:
        await writer.drain()
        if leave_after_s is not None:
            await asyncio.sleep(leave_after_s)
            return _Outcome(None)
        data = b""
        deadline = time.monotonic() + timeout
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
            if not chunk:
                break
            data += chunk
            if leave_after_events is not None and data.count(b"data: ") >= leave_after_events:
                return _Outcome(_status(data))
        return _Outcome(_status(data), _error_event(data))
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def _status(data: bytes) -> int | None:
    m = re.match(rb"HTTP/1\.1 (\d{3})", data)
    return int(m.group(1)) if m else None


def _error_event(data: bytes) -> int | None:
    """The status an error event of a stream carries (OpenAI's error object in a data: line)."""
    for line in data.split(b"\n"):
        if line.startswith(b"data: {") and b'"error"' in line:
            err = json.loads(line[6:])["error"]
            return {"request_timeout": 408, "internal_error": 500, "engine_stopped": 503}.get(err.get("code"), 500)
    return None


def _request(rng: random.Random, fault: str, max_tokens: int, long_prompt: str) -> tuple[str, dict, dict]:
    """(path, body, how the client behaves) for one request of kind `fault`."""
    chat = rng.random() < 0.4
    stream = rng.random() < 0.5
    text = " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))
    body: dict = {"max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0, 0.8]),
                  "seed": rng.randrange(1 << 30), "stream": stream, "n": 2 if rng.random() < 0.15 else 1}
    how: dict = {}
    if fault == "leave_queued":
        how["leave_after_s"] = rng.uniform(0.0, 0.005)
    elif fault == "leave_prefill":
        text, chat = long_prompt, False
        how["leave_after_s"] = rng.uniform(0.001, 0.02)
    elif fault == "leave_decode":
        body.update(stream=True, max_tokens=max_tokens * 4, ignore_eos=True)
        how["leave_after_events"] = rng.randint(2, 6)
    elif fault == "leave_blocking":
        body.update(stream=False, max_tokens=max_tokens * 4, ignore_eos=True)
        how["leave_after_s"] = rng.uniform(0.03, 0.3)
    elif fault == "deadline":
        body.update(max_tokens=max_tokens * 8, ignore_eos=True, n=1, request_timeout=rng.uniform(0.02, 0.3))
    elif fault == "bad":
        body.update(rng.choice([{"temperature": -1}, {"max_tokens": 0}, {"n": "two"}, {"top_p": 5e-324},
                                {"stop": [""]}, {"request_timeout": 0}]))
    if chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}, how
    return "/v1/completions", {**body, "prompt": text}, how


async def _drive(port: int, cfg: SoakConfig, long_prompt: str) -> tuple[collections.Counter, collections.Counter]:
    rng = random.Random(cfg.seed)
    plan = [(f, *_request(rng, f, cfg.max_tokens, long_prompt))
            for f in rng.choices(FAULTS, weights=WEIGHTS, k=cfg.requests)]
    faults = collections.Counter(f for f, *_ in plan)
    statuses: collections.Counter = collections.Counter()
    todo = iter(plan)

    async def client() -> None:
        for fault, path, body, how in todo:
            out = await _exchange(port, path, body, **how)
            statuses["none" if out.status is None else str(out.status)] += 1
            if out.error_status is not None:
                statuses[f"stream-{out.error_status}"] += 1
            if out.status == 429:   # back off a little (a real client waits Retry-After), then go on
                await asyncio.sleep(rng.uniform(0.05, 0.3))

    await asyncio.gather(*(client() for _ in range(cfg.concurrency)))
    return faults, statuses


def _long_prompt(tokenizer, tokens: int) -> str:
    """About `tokens` tokens of words (a prefill of several chunks)."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words.extend(WORDS)
    while len(words) > 1 and len(tokenizer.encode(" ".join(words))) > tokens:
        words.pop()
    return " ".join(words)


def scrape_metrics(port: int) -> str:
    """The server's /metrics text (Prometheus exposition)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def metric_value(text: str, name: str, labels: str = "") -> float:
    """One sample of `scrape_metrics` text (0 when the series is absent)."""
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def soak(server, cfg: SoakConfig) -> SoakReport:
    """Run the soak against a started `BackgroundServer` whose engine nothing else uses."""
    start = time.perf_counter()
    engine = server.server.async_engine
    long_prompt = _long_prompt(engine.inputs.tokenizer, engine.info.max_model_len // 2)
    faults, statuses = asyncio.run(_drive(server.port, cfg, long_prompt))
    deadline = time.monotonic() + 120
    while engine.call_blocking(lambda e: e.has_unfinished_requests()):
        if time.monotonic() > deadline:
            raise RuntimeError("the engine did not go idle after the soak")
        time.sleep(0.05)

    def kv_state(e):
        try:
            e.check_integrity()
            ok = True
        except AssertionError:
            ok = False
        return e.snapshot(), ok

    snap, integrity_ok = engine.call_blocking(kv_state)
    text = scrape_metrics(server.port)
    finished = {m.group(1): int(float(m.group(2)))
                for m in re.finditer(r'^gemmaserve_requests_total\{finish_reason="([a-z_]+)"\} ([0-9.e+-]+)$', text, re.M)}
    admitted = int(metric_value(text, "gemmaserve_requests_admitted_total"))
    mismatches = []
    if admitted != sum(finished.values()):
        mismatches.append(f"admitted {admitted} != finished {sum(finished.values())} {finished}")
    http = {m.group(1): int(float(m.group(2))) for m in re.finditer(
        r'^gemmaserve_http_requests_total\{status="([a-z0-9]+)"\} ([0-9.e+-]+)$', text, re.M)}
    if sum(http.values()) != cfg.requests:
        mismatches.append(f"{cfg.requests} requests sent, /metrics counted {sum(http.values())}: {http}")
    left = statuses.get("none", 0)   # these clients never saw their status: the server counted it anyway
    for status, seen in statuses.items():
        if status.isdigit() and not seen <= http.get(status, 0) <= seen + left:
            mismatches.append(f"clients saw {seen} x {status}, /metrics counted {http.get(status, 0)}")
    for status in ("400", "429"):
        counted = int(metric_value(text, "gemmaserve_http_errors_total", f'{{status="{status}"}}'))
        if counted != http.get(status, 0):
            mismatches.append(f"{status}: {counted} errors counted, {http.get(status, 0)} requests")
    seen_408 = statuses.get("408", 0) + statuses.get("stream-408", 0)   # deadline clients never leave early
    counted_408 = int(metric_value(text, "gemmaserve_http_errors_total", '{status="408"}'))
    if seen_408 != counted_408 or finished.get("timeout", 0) != counted_408:
        mismatches.append(f"408: clients {seen_408}, /metrics {counted_408}, timeouts {finished.get('timeout', 0)}")
    server_errors = sum(n for s, n in statuses.items() if s.lstrip("stream-").startswith("5"))
    return SoakReport(requests=cfg.requests, faults=dict(faults), statuses=dict(statuses),
                      server_errors=server_errors, admitted=admitted, finished=finished,
                      leaked_pages=snap.pages_used, integrity_ok=integrity_ok and snap.pages_free
                      + snap.pages_cached == snap.pages_total, accounted=not mismatches, http_counted=http,
                      mismatches=mismatches,
                      seconds=round(time.perf_counter() - start, 1))


# -- `gemmaserve bench soak` ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=positive_int, default=2000, help="requests sent in all")
    parser.add_argument("--concurrency", type=positive_int, default=24, help="clients sending at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument("--soak-max-tokens", type=positive_int, default=24, help="tokens per ordinary request")
    parser.add_argument("--max-queue-len", type=positive_int, default=8, help="the server's --max-queue-len")
    parser.add_argument("--out", default="bench-out/soak.json", help="JSON output path")


def run(args: argparse.Namespace) -> int:
    import os
    import platform

    from ..config.engine import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..server.background import BackgroundServer
    from ..server.config import ServerConfig

    engine = LLMEngine(from_namespace(EngineConfig, args))
    cfg = SoakConfig(args.requests, args.concurrency, args.seed, args.soak_max_tokens)
    with BackgroundServer(engine, ServerConfig(max_queue_len=args.max_queue_len, request_timeout=60)) as srv:
        report = soak(srv, cfg)
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "model": engine.config.model,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", **dataclasses.asdict(report),
              "faults_injected": report.faults_injected}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    ok = report.server_errors == 0 and report.leaked_pages == 0 and report.integrity_ok and report.accounted
    return 0 if ok else 1
