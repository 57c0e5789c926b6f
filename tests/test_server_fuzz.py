"""Property-based API fuzzing (schemathesis) of the real server against its own OpenAPI schema, on a
tiny random model: valid and invalid bodies for every operation; never a 5xx, every error in OpenAI's
format, and afterwards no KV page leaked. Bounded for CI; GEMMASERVE_FUZZ_EXAMPLES raises the count."""

from __future__ import annotations

import collections
import json
import os

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

from gemmaserve.config.engine import EngineConfig  # noqa: E402
from gemmaserve.engine.llm_engine import LLMEngine  # noqa: E402
from gemmaserve.server.background import BackgroundServer  # noqa: E402
from gemmaserve.server.config import ServerConfig  # noqa: E402

from helpers import assert_server_kv_clean, save_checkpoint, tiny_hf_model  # noqa: E402

EXAMPLES = int(os.environ.get("GEMMASERVE_FUZZ_EXAMPLES", "25"))   # per operation and mode
SEED = 2024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_checkpoint(tiny_hf_model(SEED), tmp_path_factory.mktemp("fuzz") / "m")
    engine = LLMEngine(EngineConfig(model=str(path), page_size=4, max_model_len=96, max_num_seqs=8,
                                    kv_cache_memory=4 << 20))
    with BackgroundServer(engine, ServerConfig(request_timeout=20, max_queue_len=64,
                                               max_request_bytes=256 << 10)) as srv:
        yield srv


def _check(response, case) -> None:
    status = response.status_code
    assert status < 500, f"{status} for {case.method} {case.path} body={case.body!r:.300}: {response.text[:300]}"
    if status >= 400:
        err = response.json().get("error")
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, response.text[:300]
        assert isinstance(err["message"], str) and err["message"]
        return
    ctype = response.headers.get("content-type") or ""
    if (ctype[0] if isinstance(ctype, list) else ctype).startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and (events[-1] == "[DONE]" or "error" in json.loads(events[-1])), response.text[-300:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    elif case.path != "/metrics":
        assert isinstance(response.json(), dict)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_never_get_a_5xx(server, mode):
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    seen = {"calls": 0, "errors": 0}
    why: collections.Counter = collections.Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue   # nothing to make invalid (GET routes without parameters)

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            response = case.call(base_url=server.base_url, timeout=60)
            seen["calls"] += 1
            seen["errors"] += response.status_code >= 400
            if response.status_code >= 400:
                why[(response.status_code, (response.json().get("error") or {}).get("param"))] += 1
            _check(response, case)

        run()
    assert seen["calls"] >= EXAMPLES   # the schema was read and requests were sent
    print(f"fuzz {mode.value}: {seen['calls']} requests, {seen['errors']} 4xx, 0 5xx; errors by (status, param): "
          f"{dict(why.most_common())}")
    assert_server_kv_clean(server)
