"""Streamed equals whole, for every API that streams parsed output: random Gemma 4 outputs (thinking anywhere,
text, parallel calls with tricky arguments) cut at random, read by each route's own streaming code and rebuilt by
the official clients' own accumulators (openai's ChatCompletionStreamState and ResponseStreamState, anthropic's
accumulate_event), give what the route answers for the whole text: chat completions, Responses and Messages."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings, strategies as st
from pydantic import TypeAdapter

from gemmaserve.server.messages.stream import BlockWriter, message_blocks
from gemmaserve.server.responses.output import OutputBuilder
from gemmaserve.server.serving_chat import ChatJob, _Answers, chat_deltas
from test_output_parser import FMT, NATIVE, _PART, native_text

openai_chat = pytest.importorskip("openai.lib.streaming.chat._completions")
openai_responses = pytest.importorskip("openai.lib.streaming.responses._responses")
anthropic_stream = pytest.importorskip("anthropic.lib.streaming._messages")
from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402
from openai.types.chat import ChatCompletionChunk  # noqa: E402
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402


def _job(opened: bool) -> ChatJob:
    """A chat job as far as reading its outputs goes: Gemma 4's thinking and native tool calls."""
    return ChatJob(None, None, None, NATIVE, _Answers(FMT, False, opened), [])


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0] + sorted(c for c in set(cuts) if 0 < c < len(text)) + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _chat(job: ChatJob, pieces: list[str]) -> dict:
    """The streamed chat message as openai's stream state rebuilds it from our chunks."""
    state = openai_chat.ChatCompletionStreamState()
    parser = job.parser()
    for i, piece in enumerate(pieces + [None]):
        events = parser.feed(piece) if piece is not None else parser.finish()
        deltas = chat_deltas(events) or [{}]
        for delta in deltas:
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if piece is None else None}]}
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    message = state.get_final_completion().choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert all(c.id.startswith("call_") for c in message.tool_calls or []) and \
        len({c.id for c in message.tool_calls or []}) == len(calls)   # each id once, never repeated into another
    return {"reasoning": getattr(message, "reasoning_content", None) or None, "content": message.content or None,
            "calls": calls}


_RESPONSE_EVENT = TypeAdapter(ResponseStreamEvent)
_MESSAGE_EVENT = TypeAdapter(RawMessageStreamEvent)


def _shape(items: list[dict], status: bool = True) -> list:
    """Output items without their random ids (and statuses: the client's running copy keeps an item's first)."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id") and (status or k != "status")}
            for item in items]


def _responses(job: ChatJob, pieces: list[str]) -> list:
    """The streamed output as openai's ResponseStreamState accumulates our typed events (before the final
    `response.completed` replaces it with the server's copy)."""
    state = openai_responses.ResponseStreamState(input_tools=[], text_format=openai_responses.omit)
    base = {"id": "resp_x", "object": "response", "created_at": 0, "model": "m", "output": [], "status": "in_progress",
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    seq = iter(range(10**6))

    thoughts: dict[int, str] = {}   # the SDK's running copy keeps messages and calls; reasoning read here

    def send(body: dict) -> None:
        state.handle_event(_RESPONSE_EVENT.validate_python({**body, "sequence_number": next(seq)}))
        if body["type"] == "response.reasoning_text.delta":
            thoughts[body["output_index"]] = thoughts.get(body["output_index"], "") + body["delta"]

    send({"type": "response.created", "response": base})
    builder, reader = OutputBuilder(), job.reader()
    for piece in pieces:
        for ev in reader.feed(piece):
            for body in builder.apply(ev):
                send(body)
    last, _ = reader.finish("stop")
    for body in [b for ev in last for b in builder.apply(ev)] + builder.finish():
        send(body)
    snapshot = state._ResponseStreamState__current_snapshot   # the client's running copy of the response
    streamed = [item.model_dump(exclude_none=True) for item in snapshot.output]
    for i, item in enumerate(streamed):
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": thoughts.get(i, "")}]
    final = Response.model_validate({**base, "output": builder.items}).output
    assert _shape(streamed, False) == _shape([item.model_dump(exclude_none=True) for item in final], False)
    return _shape(builder.items)


def _messages(job: ChatJob, pieces: list[str]) -> list[dict]:
    """The streamed message's content as anthropic's accumulate_event rebuilds it from our SSE."""
    writer, reader = BlockWriter(), job.reader()
    lines: list[str] = []
    for piece in pieces:
        for ev in reader.feed(piece):
            lines += writer.write(ev)
    last, _ = reader.finish("stop")
    for ev in last:
        lines += writer.write(ev)
    lines += writer.close()
    snapshot = Message.model_validate({"id": "msg_x", "type": "message", "role": "assistant", "model": "m",
                                       "content": [], "stop_reason": None, "stop_sequence": None,
                                       "usage": {"input_tokens": 0, "output_tokens": 0}})
    json_bufs: dict[int, bytes] = {}
    for line in lines:
        kind, data = line.strip().split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        snapshot = anthropic_stream.accumulate_event(event=_MESSAGE_EVENT.validate_python(body),
                                                     current_snapshot=snapshot, json_bufs=json_bufs)
    blocks = [b.model_dump(exclude_none=True) for b in snapshot.content]
    assert blocks == writer.blocks
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(_PART, max_size=5), opened=st.booleans(), chunk_seed=st.integers(0, 2**16))
def test_streamed_equals_whole_for_chat_responses_and_messages(parts, opened, chunk_seed):
    text, calls = native_text(parts)
    job = _job(opened)
    rng = random.Random(chunk_seed)
    chunkings = [[len(text)], list(range(len(text))),   # whole, one character at a time,
                 [rng.randrange(len(text) + 1) for _ in range(rng.randint(1, 30))]]   # and anywhere
    whole = job.read(text, "stop")
    want_chat = {"reasoning": whole.reasoning or None, "content": whole.content or None,
                 "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]}
    reader = job.reader()
    events = reader.feed(text)
    events += reader.finish("stop")[0]
    want_messages = [{k: v for k, v in b.items() if k != "id"} for b in message_blocks(events)]
    want_responses = _responses(job, [text])
    for cuts in chunkings:
        pieces = _pieces(text, cuts)
        assert _chat(job, pieces) == want_chat, pieces
        assert _responses(job, pieces) == want_responses, pieces
        assert _messages(job, pieces) == want_messages, pieces
    # calls come out as calls in every API: named, with JSON arguments
    if not opened:   # (opened: a first call may sit inside the thinking the prompt opened)
        assert want_chat["calls"] == calls
    assert [b["name"] for b in want_messages if b["type"] == "tool_use"] == [n for n, _ in want_chat["calls"]]
    assert [i["name"] for i in want_responses if i["type"] == "function_call"] == [n for n, _ in want_chat["calls"]]
