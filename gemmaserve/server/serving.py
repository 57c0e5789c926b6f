"""What every OpenAI endpoint shares: reading and checking a request (body size, model name, the engine's
validation), admission, starting a generation, collecting or streaming its outputs, and usage.

`ServingCommon` is composed into each endpoint's object (serving_completion.py, serving_chat.py,
serving_audio.py, serving_lora.py, serving_models.py), not inherited: it holds the engine's client (the only
way to the engine), the served model's facts (`ServedModel`) and how a generation starts (`StartFn`: the
engine's own, or a disaggregated role's, server/disagg.py). `OpenAIServer` (app.py) builds one per engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..engine.input_processor import InputProcessor
from ..engine.media.items import MediaItem
from ..engine.request import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..engine.validation import CheckedRequest, ContextLengthError, GrammarError
from ..errors import UserInputError
from ..models.chat_template import ChatFormatter
from ..models.tokenizer import Tokenizer
from .async_engine import Admission, DeadlineExceeded, EngineDeadError, Generation, QueueFull
from .client import EngineClient
from .config import ServerConfig
from .metrics import ServerMetrics
from .protocol import ApiError, ChatRequest, CompletionRequest, now, usage
from .reasoning import ReasoningFormat

PARSE_OFF_LOOP_BYTES = 64 << 10   # bodies above this are parsed on a worker thread
RETRY_AFTER_S = 1                 # what 429 and 503 tell clients to wait


@dataclass
class Prompt:
    text: str
    ids: list[int]


@dataclass(frozen=True)
class ServedModel:
    """What the endpoints know of the model they serve."""
    name: str                           # what responses name (--served-model-name, else the model)
    accepted_names: frozenset[str]      # what a request's `model` may say for the base model
    tokenizer: Tokenizer
    inputs: InputProcessor              # preparing prompts and media (the engine's: stateless)
    chat: ChatFormatter
    reasoning: ReasoningFormat | None   # the model's thought channel, if its tokenizer has one

    @classmethod
    def of(cls, client: EngineClient, served_names: list[str] | str | None) -> "ServedModel":
        """`served_names` (--served-model-name): what requests may name the model; responses name the first."""
        inputs = client.inputs
        model = client.info.model
        names = [served_names] if isinstance(served_names, str) else list(served_names or [model])
        return cls(names[0], frozenset({*names, model}), inputs.tokenizer, inputs, ChatFormatter(inputs.tokenizer),
                   ReasoningFormat.from_tokenizer(inputs.tokenizer))


# How a request's checked prompts start generating: (request, response id, prompts, deadline, admission)
StartFn = Callable[[CompletionRequest | ChatRequest, str, list[CheckedRequest], float | None, Admission],
                   Awaitable[Generation]]


class ServingCommon:
    def __init__(self, config: ServerConfig, metrics: ServerMetrics, client: EngineClient, model: ServedModel,
                 start: StartFn | None = None):
        """`start`: how a generation starts (None: posted to the engine, `start_here`)."""
        self.config, self.metrics, self.client, self.model = config, metrics, client, model
        self.start: StartFn = start or self.start_here

    async def engine_call(self, call: Awaitable):
        """Await a call of the engine's client, a 503 if the engine has stopped."""
        try:
            return await call
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), code="engine_stopped") from None

    async def read_json(self, request: Request) -> object:
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        body = b"".join(chunks)
        if total > PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(parse_json, body)
        return parse_json(body)

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter `name` names (None: the base model), or a 404 if it names nothing served."""
        if name is None or name in self.model.accepted_names:
            return None
        if self.client.has_adapter(name):
            return name
        adapters = self.client.adapter_names()
        served = repr(self.model.name) + (f" and the LoRA adapters {', '.join(adapters)}" if adapters else "")
        raise ApiError(404, f"model {name!r} does not exist; this server serves {served}", param="model",
                       code="model_not_found")

    def answering(self, req) -> str:
        """The model a response names: the adapter the request asked for, else the served model."""
        return req.model if req.model is not None and self.client.has_adapter(req.model) else self.model.name

    async def validate(self, prompts: list[Prompt], params: SamplingParams, param: str, grammar_param: str,
                        media: list[list[MediaItem]] | None = None, lora: str | None = None) -> list[CheckedRequest]:
        """The engine's checks of every prompt (its grammar compiled and waited for), so a bad request is a
        400 before it reaches the engine, which then queues the checked requests without checking again.
        `param` names the prompt's field in errors, `grammar_param` the structured output's."""
        try:
            return await self.client.validate([(p.text, p.ids) for p in prompts], params, media, lora)
        except ContextLengthError as exc:
            n = exc.prompt_tokens
            raise ApiError(400, f"this model's maximum context length is {exc.limit} tokens; the request asks for "
                                f"{n + exc.max_tokens} ({n} in the {param}, {exc.max_tokens} to generate)",
                           param=param, code="context_length_exceeded") from None
        except GrammarError as exc:
            raise ApiError(400, str(exc), param=grammar_param) from None
        except UserInputError as exc:
            raise ApiError(400, str(exc), param=param) from None

    def deadline(self, arrival: float, req: CompletionRequest | ChatRequest) -> float | None:
        """The earlier of the server's --request-timeout and the request's own `request_timeout`."""
        limits = [t for t in (self.config.request_timeout, req.request_timeout) if t is not None]
        return arrival + min(limits) if limits else None

    @contextlib.contextmanager
    def admit(self, completions: int):
        """Admit the request's completions for the block, which posts them through `_start` (429 if
        the server holds --max-num-seqs + --max-queue-len already; an empty queue takes any request, so
        one large request is never refused for its size alone). Withdrawn if the block fails first."""
        try:
            admission = self.client.admit(completions)
        except QueueFull as exc:
            raise ApiError(429, f"the server is overloaded: {exc}; retry after {RETRY_AFTER_S}s", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        try:
            yield admission
        finally:
            self.client.withdraw(admission)

    async def start_here(self, req: CompletionRequest | ChatRequest, rid: str, prompts: list[CheckedRequest],
                         deadline: float | None, admission: Admission) -> Generation:
        """Start generating (post to the engine under `admission`): the async iterator of (prompt
        index, output). A disaggregated role (server/disagg.py) starts from another engine's KV instead."""
        if req.kv_transfer_params is not None:
            raise ApiError(400, "kv_transfer_params needs a server started with --role prefill or decode",
                           param="kv_transfer_params")
        return self.client.generate(rid, prompts, deadline, admission=admission)

    async def stream(self, rid: str, kind: str, req: CompletionRequest | ChatRequest, prompts: list[Prompt],
                      outputs, choices, opening: list[dict] = (), opened: bool = False) -> AsyncIterator[str]:
        """Server-sent events: `opening` choices, then `choices(prompt index, completion output)` for
        every output, an error event if generation fails, the usage chunk if asked, and [DONE]."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = now()
        finals: dict[tuple[int, int], RequestOutput] = {}

        def chunk(choice: list[dict], **extra) -> str:
            body = {"id": rid, "object": kind, "created": created, "model": self.answering(req), "choices": choice,
                    **extra}
            if include_usage and "usage" not in body:
                body["usage"] = None
            return event(body)

        for choice in opening:
            yield chunk([choice])
        async with contextlib.aclosing(outputs):
            try:
                async for pi, out in outputs:
                    c = out.outputs[0]
                    raise_if_failed(c)
                    if c.finished:
                        finals[(pi, c.index)] = out
                    for choice in choices(pi, c):
                        yield chunk([choice])
            except (ApiError, EngineDeadError, UserInputError, DeadlineExceeded) as exc:
                err = as_api_error(exc)
                self.metrics.http_errors.labels(str(err.status)).inc()   # counted like any other error
                yield event(err.body())
                return
        if include_usage:
            yield chunk([], usage=self.usage(prompts, finals, opened))
        yield "data: [DONE]\n\n"

    async def collect(self, request: Request, outputs) -> dict[tuple[int, int], RequestOutput]:
        """Every completion's final output, keyed (prompt index, completion index). Aborts the
        request if the client goes away while it runs."""
        finals: dict[tuple[int, int], RequestOutput] = {}

        async def consume() -> None:
            async with contextlib.aclosing(outputs):
                async for pi, out in outputs:
                    raise_if_failed(out.outputs[0])
                    if out.outputs[0].finished:
                        finals[(pi, out.outputs[0].index)] = out

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    raise ApiError(499, "client closed the request", code="client_closed")
            try:
                task.result()
            except (EngineDeadError, UserInputError, DeadlineExceeded) as exc:
                raise as_api_error(exc) from None
        finally:
            if not task.done():
                task.cancel()
        return finals

    def usage(self, prompts: list[Prompt], finals: dict[tuple[int, int], RequestOutput], opened: bool = False) -> dict:
        """OpenAI's usage; `opened`: the prompt opened the thought channel (its output starts thinking)."""
        completion = sum(len(o.outputs[0].token_ids) for o in finals.values())
        cached = sum({pi: o.num_cached_tokens for (pi, _), o in finals.items()}.values())
        out = usage(sum(len(p.ids) for p in prompts), completion, cached)
        if self.model.reasoning is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": sum(
                self.model.reasoning.reasoning_tokens(list(o.outputs[0].token_ids), opened) for o in finals.values())}
        return out


def raise_if_failed(c) -> None:
    if c.finish_reason == "error":
        raise ApiError(500, f"internal error while generating: {c.error}", code="internal_error")


def as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, UserInputError):   # the engine's own admission check (the handler's checks come first)
        return ApiError(400, str(exc))
    if isinstance(exc, DeadlineExceeded):
        return ApiError(408, str(exc), param="request_timeout", code="request_timeout")
    return ApiError(503, str(exc), code="engine_stopped")


def parse_json(body: bytes) -> object:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"invalid JSON body: {exc}", code="invalid_json") from None


def event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that always close their generator and the generation it reads, so a client
    that disconnects aborts its request at once (not when the generator is garbage-collected), even one
    that left before the first event (an unstarted generator's aclose runs none of its code)."""

    def __init__(self, events: AsyncIterator[str], outputs: Generation, **kw):
        super().__init__(events, **kw)
        self.outputs = outputs

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()
            await self.outputs.aclose()


def sse(events: AsyncIterator[str], outputs: Generation) -> StreamingResponse:
    return EventStream(events, outputs, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

