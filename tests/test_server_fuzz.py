"""Property-based API fuzzing (schemathesis) of the real server against its own OpenAPI schema, on a
tiny random model: valid and invalid bodies for every operation; never a 5xx, every error in the route's API's
format (OpenAI's; Anthropic's on /v1/messages), and afterwards no KV page leaked. Bounded for CI; GEMMASERVE_FUZZ_EXAMPLES raises the count.

Schemathesis' negative cases rarely reach far into a body (a wrong `type` inside a chat content part gave a 500
that 25 cases per route never found), so a second test walks every JSON route's schema to each nested field
(content parts, tool specs, response_format, stream_options, logit_bias values, ...) and sends, at each one,
a value of every JSON type the field does not take, and the object without each field it requires: always a 400
naming that path."""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator

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


def _anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def _error_message(body: dict, path: str) -> str | None:
    """The error's message if `body` is an error in the route's API's format (None if it is not)."""
    err = body.get("error")
    if _anthropic(path):
        ok = body.get("type") == "error" and isinstance(err, dict) and set(err) == {"type", "message"}
    else:
        ok = isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
    return err["message"] if ok and isinstance(err["message"], str) and err["message"] else None


def _check(response, case) -> None:
    status = response.status_code
    assert status < 500, f"{status} for {case.method} {case.path} body={case.body!r:.300}: {response.text[:300]}"
    if status >= 400:
        assert _error_message(response.json(), case.path), response.text[:300]
        return
    ctype = response.headers.get("content-type") or ""
    if (ctype[0] if isinstance(ctype, list) else ctype).startswith("text/event-stream") and _anthropic(case.path):
        frames = [f.split("\n") for f in response.text.strip().split("\n\n")]
        kinds = [e.removeprefix("event: ") for e, *_ in frames]
        assert kinds[0] == "message_start" and kinds[-1] in ("message_stop", "error"), response.text[-300:]
        assert "error" not in kinds[:-1], response.text[:300]
    elif (ctype[0] if isinstance(ctype, list) else ctype).startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        # chat and completions end with [DONE] or an error; the Responses API with its final or error event
        ends = {"response.completed", "response.incomplete", "response.failed", "error"}
        last = None if not events or events[-1] == "[DONE]" else json.loads(events[-1])
        assert events and (last is None or "error" in last or last.get("type") in ends), response.text[-300:]
        for e in events[:-1]:
            body = json.loads(e)
            assert "error" not in body and body.get("type") not in ends, e
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
                why[(response.status_code, (response.json().get("error") or {}).get("param", case.path))] += 1
            _check(response, case)

        run()
    assert seen["calls"] >= EXAMPLES   # the schema was read and requests were sent
    print(f"fuzz {mode.value}: {seen['calls']} requests, {seen['errors']} 4xx, 0 5xx; errors by (status, param): "
          f"{dict(why.most_common())}")
    assert_server_kv_clean(server)


# -- every nested field of every JSON route --------------------------------------------------------------------
WRONG = {"null": None, "boolean": True, "integer": 7, "number": 1.5, "string": "x", "array": [], "object": {}}
Path = tuple  # keys and list indices from the body's top


def _deref(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        schema = root["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _branches(schema: dict, root: dict) -> list[dict]:
    """The alternatives a value at this position may take (anyOf / oneOf flattened, refs followed)."""
    schema = _deref(schema, root)
    alts = schema.get("anyOf") or schema.get("oneOf")
    return [b for alt in alts for b in _branches(alt, root)] if alts else [schema]


def _types(schema: dict, root: dict) -> set[str] | None:
    """The JSON types a position takes; None when it takes anything (no type stated)."""
    out: set[str] = set()
    for b in _branches(schema, root):
        if "const" in b or "enum" in b:
            vals = [b["const"]] if "const" in b else b["enum"]
            out |= {{bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}[type(v)]
                    for v in vals}
        elif "type" in b:
            out |= set(b["type"]) if isinstance(b["type"], list) else {b["type"]}
        else:
            return None
    return out | ({"integer"} if "number" in out else set())


def _minimal(schema: dict, root: dict):
    """A small value of the first non-null alternative: required fields only."""
    b = next((b for b in _branches(schema, root) if b.get("type") != "null"), {})
    if "const" in b or "enum" in b:
        return b["const"] if "const" in b else b["enum"][0]
    kind = b.get("type")
    if kind == "object":
        return {k: _minimal(v, root) for k, v in b.get("properties", {}).items() if k in b.get("required", ())}
    return {"array": [], "string": "x", "integer": 1, "number": 1.0, "boolean": False}.get(kind)


def _positions(schema: dict, root: dict, depth: int = 0) -> Iterator[tuple[object, Path, dict]]:
    """(a value reaching the position, the position's path in it, the position's own schema), for this position
    and every one nested below it, each alternative of a union followed."""
    yield _minimal(schema, root), (), schema
    if depth > 8:
        return
    for b in _branches(schema, root):
        if b.get("type") == "object":
            base = _minimal(b, root)
            fields = dict(b.get("properties", {}))
            if isinstance(b.get("additionalProperties"), dict):   # a map's values (logit_bias)
                fields["k"] = b["additionalProperties"]
            for key, sub in fields.items():
                for value, path, s in _positions(sub, root, depth + 1):
                    yield {**base, key: value}, (key, *path), s
    # the alternatives that are arrays take, at each index, what any of their items take (prompt: strings,
    # token ids or lists of them)
    items = [b["items"] for b in _branches(schema, root) if b.get("type") == "array" and "items" in b]
    if items:
        for value, path, s in _positions({"anyOf": items}, root, depth + 1):
            yield [value], (0, *path), s


def _put(value, path: Path, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _put(value[path[0]], path[1:], new)
    return copy


def _drop(value, path: Path, key: str):
    if not path:
        return {k: v for k, v in value.items() if k != key}
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _drop(value[path[0]], path[1:], key)
    return copy


def _render(path: Path) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" if k.isidentifier() else f"[{k!r}]"
                   for k in path).lstrip(".")


def nested_cases(openapi: dict) -> list[tuple[str, dict, Path]]:
    """(route, body, the path the server must name) for every JSON route: a wrong-typed value at each position,
    and each required field of each object left out."""
    cases = []
    for route, methods in openapi["paths"].items():
        body = ((methods.get("post") or {}).get("requestBody") or {}).get("content", {}).get("application/json")
        if body is None:
            continue
        seen = set()
        for value, path, schema in _positions(body["schema"], openapi):
            if not path:
                continue
            taken = _types(schema, openapi)
            for kind, wrong in WRONG.items():
                if taken is not None and kind not in taken and (path, kind) not in seen:
                    seen.add((path, kind))
                    cases.append((route, _put(value, path, wrong), path))
            inner = _deref(_branches(schema, openapi)[0], openapi) if len(_branches(schema, openapi)) == 1 else {}
            for key in inner.get("required", ()) if inner.get("type") == "object" else ():
                if (path, key) not in seen:
                    seen.add((path, key))
                    cases.append((route, _drop(value, path, key), (*path, key)))
    return cases


def test_wrong_types_at_every_nested_field_are_400s_naming_it(server):
    import requests   # (schemathesis' own client)

    openapi = requests.get(server.base_url + "/openapi.json", timeout=30).json()
    cases = nested_cases(openapi)
    paths = {(route, _render(path)) for route, _, path in cases}
    # the walk reaches what the schemathesis cases did not (the bug it was written for) and every JSON route
    for want in [("/v1/chat/completions", "messages[0].content[0].type"),
                 ("/v1/chat/completions", "messages[0].content[0].input_audio.data"),
                 ("/v1/chat/completions", "messages[0].tool_calls[0].function.arguments"),
                 ("/v1/chat/completions", "tools[0].function.parameters"),
                 ("/v1/chat/completions", "tool_choice.function.name"),
                 ("/v1/chat/completions", "response_format.json_schema.schema"),
                 ("/v1/completions", "stream_options.include_usage"), ("/v1/completions", "logit_bias.k"),
                 ("/v1/completions", "prompt[0][0]"), ("/v1/load_lora_adapter", "lora_path"),
                 ("/v1/responses", "input[0].content[0].image_url"), ("/v1/responses", "text.format.schema"),
                 ("/v1/messages", "messages[0].content[0].source.data"),
                 ("/v1/messages", "messages[0].content[0].content[0].type"), ("/v1/messages", "tool_choice.name"),
                 ("/v1/messages", "thinking.budget_tokens"), ("/v1/messages/count_tokens", "tools[0].input_schema")]:
        assert want in paths, want
    failures: list[tuple[int, str]] = []
    with requests.Session() as client:
        for route, body, path in cases:
            where = _render(path)
            try:
                r = client.post(server.base_url + route, json=body, timeout=60)
            except requests.RequestException as exc:
                failures.append((600, f"{type(exc).__name__} for {route} {where} body={json.dumps(body)[:200]}: {exc}"))
                continue
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            message = _error_message(body, route)   # (Anthropic's errors name no param: the message does)
            if not (r.status_code == 400 and message and message.startswith(where + ":")
                    and (_anthropic(route) or body["error"]["param"] == path[0])):
                failures.append((r.status_code, f"{r.status_code} for {route} {where} body={json.dumps(body)[:200]}: "
                                                f"{r.text[:200]}"))
    failures.sort(key=lambda f: -f[0])   # 5xx and dropped connections first
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(f for _, f in failures[:20])
    print(f"nested fuzz: {len(cases)} requests at {len(paths)} nested positions, all 400s naming the field")
    assert_server_kv_clean(server)
