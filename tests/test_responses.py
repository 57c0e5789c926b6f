"""/v1/responses (OpenAI's Responses API) through the official `openai` client, on one tiny Gemma 4 that sees images,
thinks (the channel markers) and calls tools (Gemma 4's tool tokens, a template that declares tools): text and
instructions as the chat route reads them, streams whose final response is the non-streamed one, continuations by
previous_response_id equal to sending the whole conversation, the store (GET, DELETE, store false, its bounds and
expiry), function calls and their outputs, text.format, reasoning items, images, and bad input as OpenAI's 4xx."""

from __future__ import annotations

import base64
import io
import json

import requests
import jsonschema
import numpy as np
import pytest

from gemmaserve.config.engine import EngineConfig
from gemmaserve.engine.llm_engine import LLMEngine
from gemmaserve.server.background import BackgroundServer
from gemmaserve.server.config import ServerConfig
from gemmaserve.server.protocol import ApiError
from gemmaserve.server.responses.store import ResponseStore, StoredResponse, StoreLimits
from gemmaserve.server.responses.translate import chat_messages, output_items

from helpers import (CHANNEL_BEGIN, CHANNEL_END, add_special_tokens, assert_server_kv_clean,
                     save_gemma4_vision_checkpoint, scripted_logits, tiny_hf_gemma4_vision)

openai = pytest.importorskip("openai")

SEED = 4242
EOS = 1
TOOL_TOKENS = {287: "<|tool_call>", 288: "<tool_call|>", 289: '<|"|>', 290: "<|tool_response>"}
TEMPLATE = ("{{ bos_token }}{% if enable_thinking %}<|think|>{% endif %}"
            "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
            "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}<tool_call|>{% endfor %}"
            "{% if m.name %}<|tool_response>{{ m.name }}{% endif %}<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_time", "description": "the time", "parameters": TIME, "strict": True},
         {"type": "function", "name": "get_date", "parameters": {"type": "object", "properties": {}}}]
PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"],
       "additionalProperties": False}
GREEDY = dict(model="m", temperature=0, max_output_tokens=6)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_gemma4_vision_checkpoint(tiny_hf_gemma4_vision(SEED, "31b"), tmp_path_factory.mktemp("responses") / "m")
    add_special_tokens(path, {CHANNEL_BEGIN: "<|channel>", CHANNEL_END: "<channel|>", **TOOL_TOKENS})
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", page_size=4, kv_cache_memory=8 << 20,
                                    max_num_seqs=4, cpu_compile="off"))
    with BackgroundServer(engine, ServerConfig(served_model_name="m", max_image_bytes=4096)) as srv:
        yield srv, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="x", max_retries=0, timeout=300)


def _png(side: int, seed: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _items(response) -> list[dict]:
    """A response's output items as a client sends them back."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def test_text_and_instructions_read_as_the_chat_route_reads_them(client):
    r = client.responses.create(input="hello there", instructions="be brief", **GREEDY)
    chat = client.chat.completions.create(model="m", temperature=0, max_tokens=6, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "m"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"
    message = [item for item in r.output if item.type == "message"]
    assert len(message) == 1 and message[0].role == "assistant" and message[0].content[0].type == "output_text"
    # instructions are a system message: without them the prompt is shorter
    plain = client.responses.create(input="hello there", **GREEDY)
    assert plain.usage.input_tokens < r.usage.input_tokens and plain.instructions is None


def test_a_streamed_response_is_the_non_streamed_one(client, served):
    kw = dict(input=[{"role": "user", "content": [{"type": "input_text", "text": "tell"}]}], **GREEDY)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1]
    assert final.type == ("response.completed" if whole.status == "completed" else "response.incomplete")
    got = final.response
    # the stored response is the one the stream completed with
    assert client.responses.retrieve(got.id).model_dump() == got.model_dump()
    assert got.output_text == whole.output_text and got.status == whole.status
    for u in (got.usage, whole.usage):   # (the second run may hit the prefix cache: cached_tokens differ)
        u.input_tokens_details = None
    assert got.usage == whole.usage
    assert [item.type for item in got.output] == [item.type for item in whole.output]
    message = next(item for item in got.output if item.type == "message")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta" and e.item_id == message.id)
    assert deltas == message.content[0].text
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [d.model_dump() for d in done] == [item.model_dump() for item in got.output]
    assert_server_kv_clean(served[0])


def test_reasoning_items_streamed_and_not_and_reasoning_effort(client, served):
    srv, engine = served
    tok = srv.server.model.tokenizer
    thought, answer = "two and two", "four"
    thinking = tok.encode("thought\n" + thought, add_special_tokens=False)
    script = [CHANNEL_BEGIN] + thinking + [CHANNEL_END] + tok.encode(answer, add_special_tokens=False) + [EOS]
    calls = scripted_logits(engine._model, script)
    kw = dict(model="m", input="what is it", temperature=0, max_output_tokens=len(script) + 4,
              reasoning={"effort": "low"})
    try:
        whole = client.responses.create(**kw)
        calls.clear()
        with client.responses.stream(**kw) as stream:
            events = list(stream)
            streamed = stream.get_final_response()
    finally:
        del engine._model.compute_logits
    for r in (whole, streamed):
        assert r.status == "completed" and [item.type for item in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == thought and r.output[0].summary == []
        assert r.output_text == answer
        assert r.usage.output_tokens_details.reasoning_tokens == len(thinking) + 2
        assert r.reasoning.effort == "low"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    # effort "none" turns the thinking off in the template (its "<|think|>": 9 byte tokens here), any level on
    off = client.responses.create(input="what is it", reasoning={"effort": "none"}, **GREEDY)
    on = client.responses.create(input="what is it", reasoning={"effort": "xhigh"}, **GREEDY)
    assert on.usage.input_tokens == off.usage.input_tokens + 9
    assert_server_kv_clean(srv)


def test_previous_response_id_equals_sending_the_whole_conversation(client):
    first = client.responses.create(input="hi", instructions="only here", **GREEDY)
    follow = client.responses.create(previous_response_id=first.id, input="and then", **GREEDY)
    whole = client.responses.create(input=[{"role": "user", "content": "hi"}, *_items(first),
                                           {"role": "user", "content": "and then"}], **GREEDY)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens == whole.usage.input_tokens   # (instructions are not carried on)
    assert follow.output_text == whole.output_text
    again = client.responses.create(previous_response_id=follow.id, input="so", **GREEDY)   # a chain of three
    assert again.usage.input_tokens > follow.usage.input_tokens + follow.usage.output_tokens


def test_store_false_get_and_delete(client, served):
    kept = client.responses.create(input="keep", **GREEDY)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    gone = client.responses.create(input="forget", store=False, **GREEDY)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(previous_response_id=gone.id, input="x", **GREEDY)
    r = requests.delete(f"{served[0].base_url}/v1/responses/{kept.id}")
    assert r.status_code == 200 and r.json() == {"id": kept.id, "object": "response.deleted", "deleted": True}
    for call in (lambda: client.responses.retrieve(kept.id), lambda: client.responses.delete(kept.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_a_function_call_and_its_output(client, served):
    """The call is scripted (a random model under the grammar writes whitespace for long), the grammar applied
    over it; the item, its stream events and the round trip of its output are what is tested."""
    srv, engine = served
    tok = srv.server.model.tokenizer
    text = lambda s: tok.encode(s, add_special_tokens=False)   # noqa: E731
    script = [287] + text("call:get_time{zone:") + [289] + text("cet") + [289] + text("}") + [288, EOS]
    kw = dict(model="m", tools=TOOLS, tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False,
              temperature=0, max_output_tokens=len(script) + 4)
    scripted = scripted_logits(engine._model, script)
    try:
        r = client.responses.create(input="what time is it", **kw)
        scripted.clear()
        events = list(client.responses.create(input="what time is it", stream=True, **kw))
    finally:
        del engine._model.compute_logits
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time" and calls[0].status == "completed", r.output
    assert json.loads(calls[0].arguments) == {"zone": "cet"}
    assert calls[0].call_id.startswith("call_") and r.status == "completed"
    assert r.tool_choice.name == "get_time" and [t.name for t in r.tools] == ["get_time", "get_date"]
    # streamed: the call's item and its arguments as events
    streamed = events[-1].response
    call = next(item for item in streamed.output if item.type == "function_call")
    assert events[-1].type == "response.completed" and call.name == "get_time"
    assert call.arguments == calls[0].arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [call.arguments]
    # its output, by previous_response_id or with the whole conversation: the same prompt and answer
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"}
    answer = dict(model="m", tools=TOOLS, temperature=0, max_output_tokens=4, tool_choice="none")
    follow = client.responses.create(previous_response_id=r.id, input=[result], **answer)
    whole = client.responses.create(input=[{"role": "user", "content": "what time is it"}, *_items(r), result],
                                    **answer)
    assert follow.usage.input_tokens == whole.usage.input_tokens > r.usage.input_tokens
    assert follow.output_text == whole.output_text
    with pytest.raises(openai.BadRequestError, match="call_id"):
        client.responses.create(input=[{"role": "user", "content": "x"}, {**result, "call_id": "call_other"}],
                                **answer)
    assert_server_kv_clean(srv)


def test_text_format_json_schema_gives_valid_json(client):
    r = client.responses.create(model="m", input="a pet", temperature=0, max_output_tokens=80,
                                text={"format": {"type": "json_schema", "name": "pet", "schema": PET}})
    assert r.status == "completed", r.output
    jsonschema.validate(json.loads(r.output_text), PET)
    assert r.text.format.type == "json_schema" and r.text.format.name == "pet"


def test_an_image_item(client):
    url = _png(16, 1)
    content = [{"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": url}]
    r = client.responses.create(input=[{"role": "user", "content": content}], **GREEDY)
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
    chat = client.chat.completions.create(model="m", temperature=0, max_tokens=6,
                                          messages=[{"role": "user", "content": parts}])
    text_only = client.responses.create(input="look", **GREEDY)
    assert r.usage.input_tokens == chat.usage.prompt_tokens > text_only.usage.input_tokens + 50
    assert r.output_text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="bytes") as exc:   # over --max-image-bytes
        client.responses.create(input=[{"role": "user", "content": [{"type": "input_image",
                                                                      "image_url": _png(64, 2)}]}], **GREEDY)
    assert exc.value.body["param"] == "input"


USER = {"role": "user", "content": "x"}


@pytest.mark.parametrize("method, path, body, status, param", [
    ("POST", "/v1/responses", {"input": [{"type": "bogus"}]}, 400, "input"),
    ("POST", "/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     400, "input"),
    ("POST", "/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     400, "input"),
    ("POST", "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/cat.png"}]}]}, 400, "input"),
    ("POST", "/v1/responses", {"input": [{"role": "robot", "content": "x"}]}, 400, "input"),
    ("POST", "/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, 400, "input"),
    ("POST", "/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, 400,
     "input"),
    ("POST", "/v1/responses", {}, 400, "input"),
    ("POST", "/v1/responses", {"input": "x", "previous_response_id": "resp_none"}, 404, "previous_response_id"),
    ("POST", "/v1/responses", {"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     400, "tool_choice"),
    ("POST", "/v1/responses", {"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ("POST", "/v1/responses", {"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ("POST", "/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
    ("POST", "/v1/responses", {"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text"),
    ("POST", "/v1/responses", {"input": "x", "reasoning": {"effort": "extreme"}}, 400, "reasoning"),
    ("POST", "/v1/responses", {"input": "x", "background": True}, 400, "background"),
    ("POST", "/v1/responses", {"input": "x", "top_logprobs": 3}, 400, "top_logprobs"),
    ("POST", "/v1/responses", {"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    ("POST", "/v1/responses", {"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ("POST", "/v1/responses", {"input": "x", "model": "other"}, 404, "model"),
    ("POST", "/v1/responses", [USER], 400, None),
    ("GET", "/v1/responses/resp_none", None, 404, "response_id"),
    ("DELETE", "/v1/responses/resp_none", None, 404, "response_id"),
])
def test_bad_input_is_an_openai_4xx(served, method, path, body, status, param):
    r = requests.request(method, served[0].base_url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param, err


def test_the_store_is_bounded_and_expires():
    now = [0.0]
    store = ResponseStore(StoreLimits(max_items=3, max_bytes=2000, ttl=10.0), clock=lambda: now[0])

    def entry(i: int, pad: int = 0) -> StoredResponse:
        return StoredResponse(f"r{i}", {"id": f"r{i}", "pad": "x" * pad}, ({"role": "user", "content": "hi"},))

    for i in range(4):   # the fourth pushes the oldest out
        assert store.put(entry(i))
        now[0] += 1
    assert [store.get(f"r{i}") is not None for i in range(4)] == [False, True, True, True] and len(store) == 3
    assert store.put(entry(4, pad=1850))   # by bytes: only the newest small one fits beside it
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, False, True, True]
    assert store.bytes == entry(3).size() + entry(4, pad=1850).size() <= 2000
    assert not store.put(entry(5, pad=3000)) and store.get("r5") is None   # larger than the bound alone
    assert store.delete("r3") and not store.delete("r3") and store.get("r3") is None
    now[0] += 9.5   # r4 was stored at t=4: it expires at t=14
    assert store.get("r4") is not None
    now[0] += 1
    assert store.get("r4") is None and len(store) == 0 and store.bytes == 0
    assert store.put(entry(1)) and store.get("r1").body == {"id": "r1", "pad": ""}   # a freed id is taken again


def test_a_stream_that_fails_ends_with_an_error_event(served):
    """Past its deadline mid-stream: the events so far, then OpenAI's `error` event (no completion event)."""
    # A deadline shorter than any answer: with 0.3 s a sampled end of the answer came first once in CI (the tiny
    # model's greedy answer ends within it every time)
    body = {"model": "m", "input": "hello", "stream": True, "max_output_tokens": 4000, "request_timeout": 0.005}
    r = requests.post(served[0].base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "error", events[-1]
    assert events[-1]["code"] == "request_timeout" and events[-1]["param"] == "request_timeout"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)
    assert_server_kv_clean(served[0])


def test_items_translate_to_chat_messages():
    """Audio parts (no model here hears), an answer's text then its calls as one assistant message, reasoning
    dropped, a call's output naming its function (from an earlier turn's calls too)."""
    items = output_items([
        {"role": "user", "content": [{"type": "input_text", "text": "hear"},
                                     {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
        {"type": "function_call_output", "call_id": "c0", "output": [{"type": "input_text", "text": "0"}]}])
    calls = {"c0": "h"}
    assert chat_messages(items, calls) == [
        {"role": "user", "content": [{"type": "text", "text": "hear"},
                                     {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c2", "name": "g", "content": "2"},
        {"role": "tool", "tool_call_id": "c0", "name": "h", "content": [{"type": "text", "text": "0"}]}]
    assert calls == {"c0": "h", "c1": "f", "c2": "g"}
    assert chat_messages("hi", {}) == [{"role": "user", "content": "hi"}]
    with pytest.raises(ApiError, match=r"input\[0\]\.call_id"):
        chat_messages(output_items([{"type": "function_call_output", "call_id": "c9", "output": "x"}]), {})


def test_kv_is_clean_after_everything(served):
    assert_server_kv_clean(served[0])
