"""POST /v1/messages and /v1/messages/count_tokens: a Messages request is translated into a ChatRequest
(translate.py), prepared and started by the chat endpoint, and its output read by `ChatJob.read`, so both APIs
build the same prompt and parse the same tool calls; this module shapes Anthropic's message, its usage and stop
reason, and its event stream (stream.py, from the output parser's events as they come)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...engine.request import RequestOutput
from ...errors import UserInputError
from ..async_engine import DeadlineExceeded, EngineDeadError, Generation
from ..protocol import ApiError, parse
from ..serving import as_api_error, raise_if_failed, sse
from ..serving_chat import ChatAnswer, ChatJob, ChatServing
from .errors import error_body
from .protocol import CountTokensRequest, MessagesRequest
from .stream import BlockWriter, message_blocks, sse_event
from .translate import to_chat_request


class MessagesServing:
    def __init__(self, chat: ChatServing):
        self.chat, self.common = chat, chat.common

    async def count_tokens(self, request: Request) -> JSONResponse:
        req: CountTokensRequest = parse(CountTokensRequest, await self.common.read_json(request))
        prompt = await self.chat.render(to_chat_request(req, self.common.model.reasoning))
        return JSONResponse({"input_tokens": len(prompt.ids)})

    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: MessagesRequest = parse(MessagesRequest, await self.common.read_json(request))
        job = await self.chat.prepare(to_chat_request(req, self.common.model.reasoning))
        rid = f"msg_{uuid.uuid4().hex}"
        outputs = await self.chat.start(job, rid, arrival)
        if req.stream:
            return sse(self._stream(rid, req, job, outputs), outputs)
        (out,) = (await self.common.collect(request, outputs)).values()
        c = out.outputs[0]
        reader = job.reader()
        events = reader.feed(c.text)
        last, answer = reader.finish(c.finish_reason)
        reason, sequence = _stop(answer, c.stop_reason, req)
        return JSONResponse({**self._message(rid, job), "content": message_blocks(events + last),
                             "stop_reason": reason, "stop_sequence": sequence, "usage": self._usage(job, out)})

    def _message(self, rid: str, job: ChatJob) -> dict:
        return {"id": rid, "type": "message", "role": "assistant", "model": self.common.answering(job.req),
                "content": [], "stop_reason": None, "stop_sequence": None}

    def _usage(self, job: ChatJob, out: RequestOutput | None) -> dict:
        """Anthropic's counts: input_tokens are the prompt's tokens not read from the prefix cache (the total is
        input_tokens + cache_read_input_tokens, what count_tokens answers)."""
        cached = out.num_cached_tokens if out is not None else 0
        return {"input_tokens": len(job.prompt.ids) - cached, "output_tokens":
                len(out.outputs[0].token_ids) if out is not None else 0,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    async def _stream(self, rid: str, req: MessagesRequest, job: ChatJob, outputs: Generation) -> AsyncIterator[str]:
        start = {**self._message(rid, job), "usage": self._usage(job, None)}
        yield sse_event("message_start", {"type": "message_start", "message": start})
        yield sse_event("ping", {"type": "ping"})
        events, blocks = job.reader(), BlockWriter()
        async with contextlib.aclosing(outputs):
            try:
                async for _, out in outputs:
                    c = out.outputs[0]
                    raise_if_failed(c)
                    for ev in events.feed(c.delta_text):
                        for line in blocks.write(ev):
                            yield line
                    if c.finished:
                        last, answer = events.finish(c.finish_reason)
                        for ev in last:
                            for line in blocks.write(ev):
                                yield line
                        for line in blocks.close():
                            yield line
                        reason, sequence = _stop(answer, c.stop_reason, req)
                        usage = self._usage(job, out)
                        yield sse_event("message_delta", {"type": "message_delta", "delta": {
                            "stop_reason": reason, "stop_sequence": sequence}, "usage": usage})
                        yield sse_event("message_stop", {"type": "message_stop"})
            except (ApiError, EngineDeadError, UserInputError, DeadlineExceeded) as exc:
                err = as_api_error(exc)
                self.common.metrics.http_errors.labels(str(err.status)).inc()   # counted like any other error
                yield sse_event("error", error_body(err))


def _stop(answer: ChatAnswer, matched: str | int | None, req: MessagesRequest) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): a call ends the turn as tool_use; a stop string is a stop_sequence only when
    the request gave it (the native call format stops on its own marker too); an aborted request (the server
    drained) has no reason to give."""
    finish = answer.finish_reason
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(matched, str) and matched in (req.stop_sequences or ()):
        return "stop_sequence", matched
    return ("end_turn", None) if finish == "stop" else (None, None)
