"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat pipeline.

A request (with the stored conversation of its `previous_response_id`) becomes a chat request
(translate.py) that `ChatServing.prepare` checks and `ChatServing.start` runs; the completion's text becomes
output events (`ChatJob.reader`, the output parser's), and they become the output items and, streamed, the typed events (output.py). A
response with `store` (the default) is kept for continuations, GET and DELETE (store.py).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...engine.request import RequestOutput
from ...errors import UserInputError
from ..async_engine import DeadlineExceeded, EngineDeadError, Generation
from ..protocol import ApiError, ChatRequest, parse
from ..serving import ServingCommon, as_api_error, raise_if_failed, sse
from ..serving_chat import AnswerReader, ChatJob, ChatServing
from .output import OutputBuilder, new_id
from .protocol import ResponsesRequest
from .store import ResponseStore, StoreLimits, StoredResponse
from .translate import calls_in, chat_messages, chat_request, check_supported, output_items

# the chat pipeline names its own fields in errors: the Responses fields they come from
_PARAMS = {"messages": "input", "response_format": "text", "reasoning_effort": "reasoning",
           "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}


class ResponsesServing:
    def __init__(self, common: ServingCommon, chat: ChatServing):
        self.common, self.chat = common, chat
        config = common.config
        self.store = ResponseStore(StoreLimits(config.responses_store_max_items, config.responses_store_max_bytes,
                                               config.responses_store_ttl))

    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: ResponsesRequest = parse(ResponsesRequest, await self.common.read_json(request))
        check_supported(req)
        earlier: tuple[dict, ...] = ()
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise ApiError(404, f"previous_response_id: no stored response {req.previous_response_id!r} (never "
                                    "stored, deleted or expired)", param="previous_response_id", code="not_found")
            earlier = prev.conversation
        calls = calls_in(earlier)
        new = chat_messages(req.input if req.input is not None else [], calls)
        chat_req = chat_request(req, list(earlier) + new)
        run = _Run(req, chat_req, new_id("resp"), int(time.time()), earlier + tuple(new))
        try:
            run.job = await self.chat.prepare(chat_req)
            outputs = await self.chat.start(run.job, run.id, arrival)
        except ApiError as exc:
            raise _renamed(exc) from None
        run.reader = run.job.reader()
        if req.stream:
            return sse(self._stream(run, outputs), outputs)
        finals = await self.common.collect(request, outputs)
        out = finals[(0, 0)]
        run.feed(out.outputs[0].text)
        run.end(out)
        body = self._body(run)
        self._keep(run, body)
        return JSONResponse(body)

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(self._stored(request).body)

    async def delete(self, request: Request) -> Response:
        found = self._stored(request)
        self.store.delete(found.id)
        return JSONResponse({"id": found.id, "object": "response.deleted", "deleted": True})

    def _stored(self, request: Request) -> StoredResponse:
        rid = request.path_params["response_id"]
        found = self.store.get(rid)
        if found is None:
            raise ApiError(404, f"no stored response {rid!r} (never stored, deleted or expired)", param="response_id",
                           code="not_found")
        return found

    async def _stream(self, run: "_Run", outputs: Generation) -> AsyncIterator[str]:
        """The typed events, each with its sequence number; an `error` event if generation fails."""
        seq = itertools.count()

        def event(body: dict) -> str:
            body = {"type": body["type"], "sequence_number": next(seq), **body}
            return f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        opening = self._body(run)
        yield event({"type": "response.created", "response": opening})
        yield event({"type": "response.in_progress", "response": opening})
        async with contextlib.aclosing(outputs):
            try:
                async for _, out in outputs:
                    c = out.outputs[0]
                    raise_if_failed(c)
                    for body in run.feed(c.delta_text):
                        yield event(body)
                    if c.finished:
                        for body in run.end(out):
                            yield event(body)
            except (ApiError, EngineDeadError, UserInputError, DeadlineExceeded) as exc:
                err = as_api_error(exc)
                self.common.metrics.http_errors.labels(str(err.status)).inc()   # counted as any other error
                yield event({"type": "error", "code": err.code, "message": err.message, "param": err.param})
                return
        body = self._body(run)
        self._keep(run, body)
        yield event({"type": "response.completed" if body["status"] == "completed" else "response.incomplete",
                     "response": body})

    def _keep(self, run: "_Run", body: dict) -> None:
        """Store a finished response (unless `store` is false) with its conversation through its output."""
        if run.req.store:
            answer = chat_messages(output_items(body["output"]), calls_in(run.conversation))
            self.store.put(StoredResponse(run.id, body, run.conversation + tuple(answer)))

    def _body(self, run: "_Run") -> dict:
        """The Response object: in progress (no output yet) until the run has ended."""
        req, final = run.req, run.final
        status, incomplete = "in_progress", None
        if final is not None and run.finish_reason in ("stop", "tool_calls"):
            status = "completed"
        elif final is not None:   # cut at max_output_tokens, or aborted (a drain)
            status = "incomplete"
            incomplete = {"reason": "max_output_tokens" if run.finish_reason == "length" else None}
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice
        return {
            "id": run.id, "object": "response", "created_at": run.created, "status": status,
            "completed_at": int(time.time()) if final is not None else None, "error": None,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.common.answering(run.chat_req),
            "output": run.builder.items if final is not None else [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
            "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
            "usage": self._usage(run.job, final) if final is not None else None, "user": req.user,
            "metadata": req.metadata or {},
        }

    def _usage(self, job: ChatJob, out: RequestOutput) -> dict:
        ids = list(out.outputs[0].token_ids)
        fmt = self.common.model.reasoning
        prompt = len(job.prompt.ids)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens": len(ids),
                "output_tokens_details": {"reasoning_tokens": fmt.reasoning_tokens(ids, job.answer.opened) if fmt is not None else 0},
                "total_tokens": prompt + len(ids)}


class _Run:
    """One response being made: its request, chat job, output so far and, once ended, its final output."""

    def __init__(self, req: ResponsesRequest, chat_req: ChatRequest, rid: str, created: int,
                 conversation: tuple[dict, ...]):
        self.req, self.chat_req, self.id, self.created = req, chat_req, rid, created
        self.conversation = conversation   # the chat messages before this response's answer
        self.job: ChatJob | None = None
        self.reader: AnswerReader | None = None
        self.builder = OutputBuilder()
        self.final: RequestOutput | None = None
        self.finish_reason: str | None = None

    def feed(self, delta: str) -> list[dict]:
        return [e for ev in self.reader.feed(delta) for e in self.builder.apply(ev)] if delta else []

    def end(self, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        events, answer = self.reader.finish(c.finish_reason)
        self.finish_reason = answer.finish_reason
        self.final = out
        return [e for ev in events for e in self.builder.apply(ev)] + self.builder.finish()


def _renamed(exc: ApiError) -> ApiError:
    """A chat pipeline error, naming the Responses field (`input` for `messages`, ...)."""
    exc.param = _PARAMS.get(exc.param, exc.param)
    return exc
