"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official `anthropic` client, on
one tiny Gemma 4 with an image tower, the thought channel, the native tool tokens and a template that renders
tools, thinking and tool calls: system prompts and multi-turn, streaming equal to the whole answer, thinking
blocks (the output scripted, as test_reasoning.py does), tool_use forced by tool_choice and its tool_result sent
back, stop_sequences, token counts, images, the x-api-key, and bad input as Anthropic's errors."""

from __future__ import annotations

import base64
import contextlib
import io
import json

import pytest

from gemmaserve.config.engine import EngineConfig
from gemmaserve.engine.llm_engine import LLMEngine
from gemmaserve.server.background import BackgroundServer
from gemmaserve.server.config import ServerConfig

from helpers import (
    CHANNEL_BEGIN, CHANNEL_END, add_special_tokens, assert_server_kv_clean, save_gemma4_vision_checkpoint,
    scripted_logits, tiny_hf_gemma4_vision,
)

anthropic = pytest.importorskip("anthropic")

KEY = "sk-test-messages"
CALL_BEGIN = 287
TOOL_SPECIALS = {287: "<|tool_call>", 288: "<tool_call|>", 289: '<|"|>', 290: "<|tool_response>"}
TEMPLATE = ("{{ bos_token }}{% if enable_thinking %}<|think|>{% endif %}{% if tools %}tools:{% for t in tools %} "
            "{{ t.function.name }}{% endfor %}\n{% endif %}{% for m in messages %}<start_of_turn>{{ m.role }}"
            "{% if m.name %} {{ m.name }}{% endif %}\n{{ m.content }}{% for c in m.tool_calls or [] %}<|tool_call>call:"
            "{{ c.function.name }}{{ c.function.arguments | tojson }}<tool_call|>{% endfor %}<end_of_turn>\n"
            "{% endfor %}<start_of_turn>model\n")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "forecast", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
HI = [{"role": "user", "content": "hi there"}]
MAX_IMAGE_BYTES = 4096


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_gemma4_vision_checkpoint(tiny_hf_gemma4_vision(23, "31b"), tmp_path_factory.mktemp("msg") / "m")
    add_special_tokens(path, {**TOOL_SPECIALS, CHANNEL_BEGIN: "<|channel>", CHANNEL_END: "<channel|>"})
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", page_size=4, max_num_seqs=4,
                                    kv_cache_memory=8 << 20, cpu_compile="off"))
    with BackgroundServer(engine, ServerConfig(api_key=KEY, served_model_name="gemma",
                                               max_image_bytes=MAX_IMAGE_BYTES)) as srv:
        yield srv, engine


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[0].base_url, api_key=KEY, max_retries=0, timeout=300)


GREEDY = {"extra_body": {"temperature": 0}}   # (the client has no temperature argument any more; the API takes it)


def _ask(client, **kw):
    return client.messages.create(**{"model": "gemma", "max_tokens": 8, "messages": HI, **GREEDY, **kw})


def _content(msg) -> list[dict]:
    """A message's blocks as plain values (the stream's final message has parsed subclasses of them)."""
    return [{k: v for k, v in b.model_dump().items() if k != "parsed_output"} for b in msg.content]


@contextlib.contextmanager
def _scripted(served, text: str = "", first: list[int] = (), end: bool = True):
    """The model writes `first` tokens, then `text`, then (`end`) its end token, whatever its weights say; one
    request at a time."""
    srv, engine = served
    tok = srv.server.model.tokenizer
    script = list(first) + tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if end else [])
    calls = scripted_logits(engine._model, script)
    try:
        yield calls, script
    finally:
        del engine._model.compute_logits


def _count(client, **kw) -> int:
    return client.messages.count_tokens(**{"model": "gemma", "messages": HI, **kw}).input_tokens


def _tokenize(served, messages: list[dict], **kw) -> int:
    """What /tokenize (the OpenAI chat rendering) counts for the same conversation."""
    import requests

    r = requests.post(served[0].base_url + "/tokenize", json={"messages": messages, **kw},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_system_and_turns_become_the_chat_prompt(served, client):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
             {"role": "user", "content": [{"type": "text", "text": "how "}, {"type": "text", "text": "so"}]}]
    msg = _ask(client, system="be brief", messages=turns)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == "gemma"
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 8
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    # the same prompt as the OpenAI chat rendering of the same conversation; system blocks read as the string
    openai_shaped = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "yo"}, {"role": "user", "content": "how so"}]
    want = _tokenize(served, openai_shaped)
    assert _count(client, system="be brief", messages=turns) == want
    assert _count(client, system=[{"type": "text", "text": "be brief"}], messages=turns) == want
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == want
    again = _ask(client, system="be brief", messages=turns)   # the prefix cache is read: counted apart
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == want
    assert again.content == msg.content   # greedy


def test_stream_gives_the_same_message(served, client):
    kw = dict(messages=HI, max_tokens=10, **GREEDY)
    whole = _ask(client, **kw)
    with client.messages.stream(model="gemma", **kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert _content(final) == _content(whole) and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    assert events.count("content_block_start") == events.count("content_block_stop") == 1
    # on the wire: each event's `event:` line names its type, as Anthropic's do (the client skips pings)
    import requests

    body = {"model": "gemma", "messages": HI, "max_tokens": 10, "stream": True}
    r = requests.post(served[0].base_url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = [f.split("\n") for f in r.text.strip().split("\n\n")]
    assert all(e.startswith("event: ") and d.startswith("data: ") for e, d in frames)
    kinds = [e[7:] for e, _ in frames]
    assert kinds == [json.loads(d[6:])["type"] for _, d in frames]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]


def test_thinking_blocks(served, client):
    tok = served[0].server.model.tokenizer
    thought = [CHANNEL_BEGIN] + tok.encode("thought\ntwo and two", add_special_tokens=False) + [CHANNEL_END]
    thinking = {"type": "enabled", "budget_tokens": 1024}
    with _scripted(served, "four", thought) as (calls, script):
        msg = _ask(client, thinking=thinking, max_tokens=40)
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert msg.content[0].thinking == "two and two" and msg.content[0].signature
        assert msg.content[1].text == "four" and msg.stop_reason == "end_turn"
        assert msg.usage.output_tokens == len(script)
        calls.clear()
        with client.messages.stream(model="gemma", messages=HI, max_tokens=40, thinking=thinking,
                                    **GREEDY) as stream:
            deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
        assert _content(final) == _content(msg)
        assert deltas.index("signature_delta") < deltas.index("text_delta") and "thinking_delta" in deltas
    # the template sees enable_thinking ("<|think|>" takes 9 byte tokens here); disabled is the default
    assert _count(client, thinking=thinking) == _count(client) + 9 == _count(client, thinking={"type": "disabled"}) + 9


def test_tool_use_and_tool_result_round_trip(served, client):
    """The call is begun by script (a random model may open its thought channel first, where anything goes,
    and end there); its arguments are the model's own, constrained to the schema."""
    with _scripted(served, first=[CALL_BEGIN], end=False):
        msg = _ask(client, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather",
                                                     "disable_parallel_tool_use": True}, max_tokens=120)
    assert msg.stop_reason == "tool_use", msg
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city", "days"} and 1 <= use.input["days"] <= 7
    assert use.id
    # streamed: the call arrives as input_json_delta and is parsed back by the client
    with _scripted(served, first=[CALL_BEGIN], end=False), client.messages.stream(
            model="gemma", messages=HI, max_tokens=120, tools=TOOLS,
            tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas and final.stop_reason == "tool_use"
    assert [b.name for b in final.content if b.type == "tool_use"][0] in {"get_weather", "get_time"}
    # the result goes back: the assistant's turn as the client gives it, then a user turn with the tool_result
    turns = HI + [msg.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}, {"type": "text", "text": "so?"}]}]
    reply = _ask(client, tools=TOOLS, messages=turns)
    assert reply.stop_reason in ("max_tokens", "end_turn", "tool_use")
    call = {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}
    openai_shaped = HI + [{"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "name": "get_weather", "content": "sunny"},
                          {"role": "user", "content": "so?"}]
    counted = _count(client, tools=TOOLS, messages=turns)
    assert counted > _count(client, tools=TOOLS, messages=HI)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    # (the OpenAI rendering without tools: the tools line is the only difference)
    assert counted == _tokenize(served, openai_shaped) + _count(client, tools=TOOLS) - _count(client)
    # a tool_choice of none offers nothing
    assert _count(client, tools=TOOLS, tool_choice={"type": "none"}) == _count(client)


def test_stop_sequences(served, client):
    with _scripted(served, "abc def ghi") as (calls, _):
        assert _ask(client, max_tokens=20).content[0].text == "abc def ghi"
        calls.clear()
        cut = _ask(client, max_tokens=20, stop_sequences=["zzzz", "ef g"])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "ef g"
        assert [b.text for b in cut.content] == ["abc d"]
        calls.clear()
        with client.messages.stream(model="gemma", messages=HI, max_tokens=20, stop_sequences=["ef g"],
                                    **GREEDY) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == "ef g"
        assert _content(final) == _content(cut)
        calls.clear()
        assert _ask(client, max_tokens=20, stop_sequences=["zzzz"]).stop_reason == "end_turn"


def test_output_format_is_enforced(served, client):
    schema = {"type": "object", "properties": {"legs": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["legs"], "additionalProperties": False}
    with _scripted(served, "{", end=False):   # (past a thought channel a random model might not end)
        msg = _ask(client, max_tokens=200, output_config={"format": {"type": "json_schema", "schema": schema}},
                   extra_body={"temperature": 1.0})
    assert msg.stop_reason == "end_turn" and set(json.loads(msg.content[0].text)) == {"legs"}
    with pytest.raises(anthropic.BadRequestError, match="output_config.format cannot be combined with tools"):
        _ask(client, tools=TOOLS, output_config={"format": {"type": "json_schema", "schema": schema}})


def _png(side: int, seed: int = 0) -> str:
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_images(client):
    small = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(16)}}
    turn = [{"role": "user", "content": [small, {"type": "text", "text": "what is it"}]}]
    msg = _ask(client, messages=turn, max_tokens=4)
    assert msg.usage.output_tokens == 4
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == _count(client, messages=turn) > _count(
        client, messages=[{"role": "user", "content": "what is it"}]) + 10   # the image's soft tokens
    big = {**small, "source": {**small["source"], "data": _png(64)}}   # over the server's max_image_bytes
    remote = {"type": "image", "source": {"type": "url", "url": "https://x.org/a.png"}}   # the server fetches nothing
    for image, match in ((big, "larger than 4096 bytes"), (remote, "data: URL")):
        with pytest.raises(anthropic.BadRequestError, match=match) as info:
            _ask(client, messages=[{"role": "user", "content": [image]}])
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"


def test_keys(served):
    url = served[0].base_url
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.count_tokens(model="gemma",
                                                                                                messages=HI)
    assert info.value.status_code == 401 and info.value.body["error"]["type"] == "authentication_error"
    import requests

    body = {"model": "gemma", "messages": HI}
    ok = requests.post(url + "/v1/messages/count_tokens", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0
    # the OpenAI routes take the x-api-key too, and keep their own error shape
    assert requests.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    bad = requests.get(url + "/v1/models", headers={"x-api-key": "wrong"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("body, match", [
    ({"model": "gemma", "messages": HI}, r"max_tokens: field required"),
    ({"model": "gemma", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]},
     r"messages\[0\]\.content\[0\]\.type: must be one of"),
    ({"model": "gemma", "max_tokens": 4, "messages": HI, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}},
     "'nope', which is not among the tools"),
    ({"model": "gemma", "max_tokens": 4, "messages": HI + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "nope", "input": {}}]}, HI[0]], "tools": TOOLS},
     "tool 'nope', which is not among the tools"),
    ({"model": "gemma", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]}, "which no earlier assistant turn made"),
    ({"model": "gemma", "max_tokens": 4, "messages": HI + [{"role": "assistant", "content": "The answer is"}]},
     "prefill"),
    ({"model": "gemma", "max_tokens": 4, "messages": HI, "stop_sequences": [""]}, "stop"),
    ({"model": "gemma", "max_tokens": 4, "messages": HI, "temperature": "hot"}, "temperature"),
    ({"model": "gemma", "max_tokens": 10 ** 6, "messages": HI}, "maximum context length"),
])
def test_bad_input_is_an_anthropic_400(served, client, body, match):
    with pytest.raises(anthropic.BadRequestError, match=match) as info:
        client.post("/v1/messages", body=body, cast_to=object)
    assert info.value.status_code == 400
    assert info.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                          "message": info.value.body["error"]["message"]}}


def test_other_errors_in_anthropic_shape(served, client):
    with pytest.raises(anthropic.NotFoundError) as info:
        _ask(client, model="claude-9")
    assert info.value.body["error"]["type"] == "not_found_error"
    import requests

    r = requests.get(served[0].base_url + "/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = requests.post(served[0].base_url + "/v1/messages", data=b"{nope", headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert_server_kv_clean(served[0])
