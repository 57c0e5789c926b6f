"""Structured output and tool calling over HTTP, on tiny random models (sampling at temperature 1:
unconstrained they would write anything): response_format json_object / json_schema, tools in the
JSON format (no tool tokens) and in Gemma 4's native format (a vocabulary with its tool tokens and a
template that declares tools), streamed and not; bad schemas and tool specs are 400s."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gemmaserve.config.engine import EngineConfig
from gemmaserve.engine.llm_engine import LLMEngine
from gemmaserve.engine.structured.structured_output import GrammarKind, StructuredOutput
from gemmaserve.server.background import BackgroundServer
from gemmaserve.server.config import ServerConfig
from gemmaserve.server.tools import gemma_arguments

from helpers import assert_server_kv_clean, fresh_seed, save_checkpoint, tiny_hf_model

openai = pytest.importorskip("openai")

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer",
                                                                                    "minimum": 0, "maximum": 9}},
          "required": ["kind", "legs"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
HOT = dict(temperature=1.0, max_tokens=200)   # a random model spends many tokens on whitespace
USER = [{"role": "user", "content": "abc"}]
NATIVE_SPECIALS = {290: "<|tool_call>", 291: "<tool_call|>", 292: '<|"|>', 293: "<|tool_response>"}
NATIVE_TEMPLATE = ("{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
                   "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}model:")


def _server(path):
    engine = LLMEngine(EngineConfig(model=str(path), page_size=4, max_num_seqs=8))
    return BackgroundServer(engine, ServerConfig(served_model_name=["m", "m-alias"]))   # several names: any works


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def srv(tiny_path):
    with _server(tiny_path) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)


def test_several_served_names_are_each_accepted_and_responses_name_the_first(client):
    assert [m.id for m in client.models.list().data] == ["m"]
    r = client.completions.create(model="m-alias", prompt="abc", max_tokens=2)
    assert r.model == "m"
    with pytest.raises(openai.NotFoundError, match="model 'other' does not exist"):
        client.completions.create(model="other", prompt="abc", max_tokens=2)


def _complete(choices) -> list:
    """The choices that finished before max_tokens (at least one must)."""
    done = [c for c in choices if c.finish_reason != "length"]
    assert done, [c.message for c in choices]
    return done


def _valid_calls(choice, allowed: dict[str, dict]) -> list:
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
    calls = choice.message.tool_calls
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])
    return calls


def test_the_server_builds_the_grammars_at_start(srv, client):
    """The per-tokenizer state is built before the server says ready and the json_object grammar
    right after, not by the first structured request; the CPU mask kernel by the first request
    whose masks are applied on the CPU, in the background."""
    grammars = srv.server.async_engine._engine._grammars
    assert grammars.is_ready()
    assert grammars.submit(StructuredOutput(GrammarKind.JSON)).result(timeout=60) is not None
    client.completions.create(model="m", prompt="abc", max_tokens=2, extra_body={"response_format": {"type": "json_object"}})
    assert grammars.wait_for_kernel(timeout=300)


def test_response_format_json_schema_and_json_object(client):
    r = client.chat.completions.create(model="m", messages=USER, n=3, seed=fresh_seed(), **HOT,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "pet", "schema": SCHEMA}})
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert done, [c.finish_reason for c in r.choices]
    for c in done:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    r = client.completions.create(model="m", prompt="abc", seed=1, temperature=1.0, max_tokens=120,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:   # cut at max_tokens: still the start of an object
        assert r.choices[0].text.lstrip().startswith("{")


def test_tools_in_json_format_required_named_and_streamed(client, srv):
    allowed = {"get_weather": WEATHER, "get_time": TIME}
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required", n=4,
                                       seed=fresh_seed(), **HOT)
    for c in _complete(r.choices):
        _valid_calls(c, allowed)
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, seed=fresh_seed(), n=4, **HOT,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    for c in _complete(r.choices):
        assert [call.function.name for call in _valid_calls(c, allowed)] == ["get_time"]
    # A conversation that already called a tool and got its result.
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_time", "content": "12:00"}]
    stream = client.chat.completions.create(model="m", messages=history, tools=TOOLS, n=4, stream=True,
                                            seed=fresh_seed(), **HOT,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    finish = {d.index: d.finish_reason for d in chunks if d.finish_reason}
    calls = {d.index: d.delta.tool_calls for d in chunks if d.delta.tool_calls}
    assert sorted(finish) == [0, 1, 2, 3] and "tool_calls" in finish.values(), finish
    for i, reason in finish.items():
        assert (reason == "tool_calls") == (i in calls)
    for got in calls.values():
        assert got[0].function.name == "get_time" and json.loads(got[0].function.arguments)["zone"] in ("utc", "cet")
    # auto: free text unless the whole answer is a call; either way a well-formed message.
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, seed=1, temperature=1.0, max_tokens=8)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    assert_server_kv_clean(srv)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                              "arguments": "[1"}}]}]},
     "messages"),
])
def test_bad_structured_requests_are_400s(client, srv, body, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**{"model": "m", "messages": USER, "max_tokens": 4, **body})
    assert exc.value.body["param"] == param, exc.value.body
    assert_server_kv_clean(srv)


def test_native_gemma4_tool_calls(tmp_path):
    """A vocabulary with Gemma 4's tool tokens and a template that declares tools: calls are written
    <|tool_call>call:NAME{...}<tool_call|>, constrained to each tool's schema, and parsed back."""
    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "m")
    tok = json.loads((path / "tokenizer.json").read_text())
    for i, text in NATIVE_SPECIALS.items():
        tok["added_tokens"].append(dict(id=i, content=text, single_word=False, lstrip=False, rstrip=False,
                                        normalized=False, special=True))
        tok["model"]["vocab"][text] = i
    (path / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": NATIVE_TEMPLATE}))
    allowed = {"get_weather": WEATHER, "get_time": TIME}
    with _server(path) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        # One call each: after it only the end of the answer is allowed (a random model would write bytes).
        r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required", n=4,
                                           parallel_tool_calls=False, seed=fresh_seed(), **HOT)
        for c in _complete(r.choices):
            _valid_calls(c, allowed)
            assert not c.message.content
        r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, seed=fresh_seed(), n=4, **HOT,
                                           parallel_tool_calls=False,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        for c in _complete(r.choices):
            assert [call.function.name for call in _valid_calls(c, allowed)] == ["get_weather"]
        _streamed_calls_equal_whole_ones(client, allowed)
        assert_server_kv_clean(s)


def _streamed_calls_equal_whole_ones(client, allowed: dict[str, dict]) -> None:
    """The same seeded request streamed and not: openai's own accumulator rebuilds the same message from the
    chunks (ids apart: each response makes its own); each call's first chunk carries its index, id, type and name,
    later ones its index and argument fragments (OpenAI's shape: the accumulator joins repeated ids)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    kw = dict(model="m", messages=USER, tools=TOOLS, tool_choice="required", temperature=1.0, max_tokens=80)
    calls = 0
    base = fresh_seed()
    for seed in (base, base + 1):
        whole = client.chat.completions.create(seed=seed, **kw).choices[0]
        state, seen = ChatCompletionStreamState(), {}
        for chunk in client.chat.completions.create(seed=seed, stream=True, **kw):
            state.handle_chunk(chunk)
            for entry in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if entry.index not in seen:
                    assert entry.id.startswith("call_") and entry.type == "function" and entry.function.name, entry
                    seen[entry.index] = entry.id
                else:
                    assert entry.id in (None, seen[entry.index]) and entry.function.name is None, entry
        streamed = state.current_completion_snapshot.choices[0]   # (get_final_completion refuses "length")
        assert streamed.finish_reason == whole.finish_reason
        assert (streamed.message.content or None) == whole.message.content   # the opening delta's "" or None
        got = [(c.id, c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []]
        assert [(i, name, args) for i, (_, name, args) in enumerate(got)] == [
            (i, c.function.name, c.function.arguments) for i, c in enumerate(whole.message.tool_calls or [])]
        assert [c[0] for c in got] == [seen[i] for i in range(len(got))]
        if whole.finish_reason == "tool_calls":
            _valid_calls(streamed, allowed)
        calls += len(got)
    assert calls, "no seeded request called"


def test_gemma_argument_syntax():
    q = '<|"|>'
    text = (f"{{city:{q}São, {{Paulo}}]{q},days:3,ok:true,none:null,ratio:-1.5e2,"
            f"list:[{q}a{q}, 2, [true]],nested:{{deep:{{x:{q}y{q}}}}},{q}quoted key{q}:1}}")
    assert gemma_arguments(text) == {"city": "São, {Paulo}]", "days": 3, "ok": True, "none": None, "ratio": -150.0,
                                     "list": ["a", 2, [True]], "nested": {"deep": {"x": "y"}}, "quoted key": 1}
    assert gemma_arguments("{}") == {}
    for bad in ("{city:" + q + "x}", "{a:1", "[1]", "{a:1}}", "{a 1}", "{a:tru}"):
        with pytest.raises(ValueError):
            gemma_arguments(bad)
