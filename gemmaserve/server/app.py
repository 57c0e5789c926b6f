"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`.

    POST /v1/completions        POST /v1/chat/completions     (JSON, or server-sent events with stream)
    GET  /v1/models             GET  /health                  GET  /metrics (Prometheus text)

Every error is OpenAI's JSON (`{"error": {"message", "type", "param", "code"}}`): 400 for a bad
request, 401 for a missing or wrong API key, 404 for an unknown model, 408 past the request's
deadline, 413 for an oversized body, 429 (with Retry-After) when the server holds --max-num-seqs +
--max-queue-len completions (counted from admission until each leaves the engine), 503 while
the model loads or the server drains. A handler validates everything it can (types, sampling values,
prompt length, KV budget) before the request reaches the engine, so a stream that has started only
fails for an internal error or its deadline. Tokenising, chat templating and parsing large bodies run
on worker threads: the event loop only moves bytes, so /health answers at once whatever the prompts.

Structured output: `response_format` (json_object, json_schema: always enforced) on both endpoints;
`tools` / `tool_choice` on chat, in the model's own call format (server/tools.py). The grammar is
compiled on a worker thread; a bad schema or tool spec is a 400 before anything is queued.

Lifecycle (ServerState): LOADING (the engine loads on a thread; /health 503) -> READY -> DRAINING
(SIGTERM: /health and new requests 503, running ones finish or, after --shutdown-timeout, are aborted),
then exit; FAILED when the engine did not load or its thread died.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.images import decode_data_url, expand_prompt, place_images
from ..engine.llm_engine import LLMEngine
from ..engine.request import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..engine.structured_output import INSTALL_HINT, TOOL_RESPONSE, import_libraries
from ..errors import UserInputError
from ..models.chat_template import ChatFormatter, ChatMessage, parse_chat
from .async_engine import Admission, AsyncEngine, DeadlineExceeded, EngineDeadError, Generation, QueueFull
from .config import ServerConfig
from .metrics import ServerMetrics
from .protocol import (
    ApiError, ChatRequest, CompletionRequest, chat_logprobs, completion_logprobs, now, parse, reject_unsupported,
    sampling_params, usage,
)
from .tools import ToolCalling, ToolFormat, parse_tools

log = logging.getLogger(__name__)

MAX_PROMPTS = 256            # prompts in one completions request
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


PARSE_OFF_LOOP_BYTES = 64 << 10   # bodies above this are parsed on a worker thread
RETRY_AFTER_S = 1                 # what 429 and 503 tell clients to wait


class ServerState(enum.Enum):
    LOADING = "loading"
    READY = "ok"
    DRAINING = "draining"
    FAILED = "failed"     # the engine did not load, or its thread died


@dataclass
class _Prompt:
    text: str
    ids: list[int]


class OpenAIServer:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], config: ServerConfig | None = None):
        """`engine`: a loaded engine, or a function that loads one; it then runs on a thread once the
        server listens, and /health says 503 "loading" until it returns."""
        self.config = config or ServerConfig()
        self.metrics = ServerMetrics()
        self.created = now()
        self.state = ServerState.LOADING
        self.load_error: BaseException | None = None
        self.in_flight = 0   # /v1 requests in progress, from arrival (tokenising included) to their end
        self._loader = engine if not isinstance(engine, LLMEngine) else None
        if isinstance(engine, LLMEngine):
            self._attach(engine)
        self.app = self._build_app()

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        # response_format and tools need the grammars' per-tokenizer state: built now (0.3 s for 262k
        # tokens once the libraries are imported, see _build_app) rather than by the first such request,
        # and before the server says ready, as doing it later would hold up /health for tenths of a second.
        try:
            engine.grammars.warm_up().result()
        except Exception as exc:   # a structured request will say what is missing; the rest is served
            log.warning("structured output is unavailable: %s", exc)
        self.tokenizer = engine.tokenizer
        self.async_engine = AsyncEngine(engine, self.metrics, self.config.max_queue_len)
        self.chat = ChatFormatter(engine.tokenizer)
        self.model_name = self.config.served_model_name or engine.config.model
        self.accepted_names = {self.model_name, engine.config.model}

    def _load(self, importing: threading.Thread) -> None:
        """The loader's thread: load, then start the engine thread and become ready. `importing`
        imports the grammar libraries meanwhile; ready waits for it (done long before for a model
        that takes seconds to load): importing them later would hold up /health."""
        try:
            self._attach(self._loader())
            importing.join()
            self.async_engine.start()
        except BaseException as exc:   # reported by serve(); the server stops
            log.error("the engine failed to load: %s", exc)
            self.load_error = exc
            self.state = ServerState.FAILED
            return
        if self.state is ServerState.LOADING:
            self.state = ServerState.READY
            log.info("serving %s (chat: %s)", self.model_name, self.chat.source)

    async def drain(self, timeout: float) -> None:
        """Stop taking requests; let running ones finish for `timeout` seconds, then abort the rest
        (their clients get what was generated, finish_reason "abort")."""
        if self.state in (ServerState.READY, ServerState.LOADING):
            self.state = ServerState.DRAINING
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        engine = getattr(self, "async_engine", None)
        if self.in_flight and engine is not None:
            log.warning("shutdown: aborting %d request(s) still running after %.1fs", self.in_flight, timeout)
            engine.abort_all()
            give_up = time.monotonic() + 5.0
            while self.in_flight and time.monotonic() < give_up:
                await asyncio.sleep(0.02)
                if engine.active:   # one that was still tokenising reached the engine after the abort
                    engine.abort_all()

    # -- app -----------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            if self._loader is not None:
                importing = threading.Thread(target=import_libraries, name="gemmaserve-import", daemon=True)
                importing.start()
                threading.Thread(target=self._load, args=(importing,), name="gemmaserve-load", daemon=True).start()
            else:
                self.async_engine.start()
                self.state = ServerState.READY
                log.info("serving %s (chat: %s)", self.model_name, self.chat.source)
            try:
                yield
            finally:
                if self.state is not ServerState.FAILED:
                    self.state = ServerState.DRAINING
                if hasattr(self, "async_engine"):
                    await asyncio.to_thread(self.async_engine.shutdown)

        app = FastAPI(title="gemmaserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
        v1 = APIRouter(prefix="/v1", dependencies=[Depends(self._authorize), Depends(self._require_ready)])
        v1.add_api_route("/completions", self.completions, methods=["POST"], openapi_extra=_body(CompletionRequest),
                         responses=_ERRORS)
        v1.add_api_route("/chat/completions", self.chat_completions, methods=["POST"], openapi_extra=_body(ChatRequest),
                         responses=_ERRORS)
        v1.add_api_route("/models", self.models, methods=["GET"], responses=_ERRORS)
        app.include_router(v1)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_text, methods=["GET"])
        app.openapi = lambda: _openapi(app)
        app.add_middleware(_TrackRequests, server=self)
        app.add_exception_handler(ApiError, self._api_error)
        app.add_exception_handler(StarletteHTTPException, self._http_error)
        app.add_exception_handler(Exception, self._internal_error)
        return app

    def _error_response(self, err: ApiError) -> JSONResponse:
        self.metrics.http_errors.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def _api_error(self, request: Request, exc: ApiError) -> JSONResponse:
        return self._error_response(exc)

    async def _http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                            str(exc.detail))
        return self._error_response(ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404
                                             else None))

    async def _internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return self._error_response(ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error"))

    async def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    # -- small routes ----------------------------------------------------------------------------------
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "gemmaserve", "root": self.engine.config.model,
                                            "max_model_len": self.engine.max_model_len}]}

    def _current_state(self) -> ServerState:
        if self.state is ServerState.READY and not self.async_engine.alive:
            self.state = ServerState.FAILED
        return self.state

    async def health(self) -> Response:
        """Readiness: 200 only when requests are being taken (a load balancer's probe)."""
        state = self._current_state()
        if state is ServerState.READY:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped" if state is ServerState.FAILED else state.value},
                            status_code=503)

    async def _require_ready(self) -> None:
        state = self._current_state()
        if state is ServerState.READY:
            return
        why = {ServerState.LOADING: "the model is still loading", ServerState.DRAINING: "the server is shutting down",
               ServerState.FAILED: "the engine is not running"}[state]
        raise ApiError(503, why, code=f"server_{state.name.lower()}",
                       headers={"Retry-After": str(RETRY_AFTER_S)} if state is ServerState.LOADING else None)

    async def metrics_text(self) -> Response:
        snap = None
        if hasattr(self, "async_engine") and self.async_engine.alive:
            snap = await self._engine_call(self.async_engine.snapshot)
        return Response(self.metrics.render(snap), media_type=CONTENT_TYPE_LATEST)

    async def _engine_call(self, fn):
        try:
            return await self.async_engine.call(fn)
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), code="engine_stopped") from None

    # -- request checks --------------------------------------------------------------------------------
    async def _json(self, request: Request) -> object:
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
            return await asyncio.to_thread(_parse_json, body)
        return _parse_json(body)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _encode(self, text: str, param: str) -> _Prompt:
        if not text.strip():
            raise ApiError(400, f"{param} must not be empty", param=param)
        return _Prompt(text, self.tokenizer.encode(text))

    def _completion_prompts(self, prompt) -> list[_Prompt]:
        """A string, a list of strings, a list of token ids, or a list of token-id lists. Tokenises:
        called on a worker thread."""
        if isinstance(prompt, str):
            return [self._encode(prompt, "prompt")]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                out.append(self._encode(p, f"prompt[{i}]"))
            elif not p:
                raise ApiError(400, f"prompt[{i}] must not be empty", param="prompt")
            else:
                vocab = self.engine.model.vocab_size
                if min(p) < 0 or max(p) >= vocab:
                    raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
                out.append(_Prompt(self.tokenizer.decode(p, skip_special_tokens=False), list(p)))
        return out

    def _chat_images(self, urls: list[str]) -> list:
        """Pixels of each image part: data: URLs only (the server opens no file and fetches no URL)."""
        limits = self.config.image_limits
        if len(urls) > limits.max_images:
            raise UserInputError(f"{len(urls)} images; at most {limits.max_images} per request")
        for i, url in enumerate(urls):   # refuse before decoding anything
            if not url.startswith("data:"):
                decode_data_url(url, limits, f"image {i}")
        return self.engine.inputs.load_images([decode_data_url(u, limits, f"image {i}") for i, u in enumerate(urls)], limits)

    def _check_fits(self, prompts: list[_Prompt], params: SamplingParams, param: str, images=None) -> None:
        limit = self.engine.max_model_len
        for p in prompts:
            if len(p.ids) + params.max_tokens > limit:
                raise ApiError(400, f"this model's maximum context length is {limit} tokens; the request asks for "
                                    f"{len(p.ids) + params.max_tokens} ({len(p.ids)} in the {param}, "
                                    f"{params.max_tokens} to generate)", param=param, code="context_length_exceeded")
            try:   # pure: KV geometry and vocabulary (the grammar was compiled by _check_grammar)
                self.engine.inputs.check_request(p.ids, params, images, wait_for_grammar=False)
            except UserInputError as exc:
                raise ApiError(400, str(exc), param=param) from None

    def _deadline(self, arrival: float, req: CompletionRequest | ChatRequest) -> float | None:
        """The earlier of the server's --request-timeout and the request's own `request_timeout`."""
        limits = [t for t in (self.config.request_timeout, req.request_timeout) if t is not None]
        return arrival + min(limits) if limits else None

    @contextlib.contextmanager
    def _admit(self, completions: int):
        """Admit the request's completions for the block, which posts them through `_start` (429 if
        the server holds --max-num-seqs + --max-queue-len already; an empty queue takes any request, so
        one large request is never refused for its size alone). Withdrawn if the block fails first."""
        try:
            admission = self.async_engine.admit(completions)
        except QueueFull as exc:
            raise ApiError(429, f"the server is overloaded: {exc}; retry after {RETRY_AFTER_S}s", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        try:
            yield admission
        finally:
            self.async_engine.withdraw(admission)

    async def _start(self, req: CompletionRequest | ChatRequest, rid: str, prompts: list[tuple[str, list[int]]],
                     params: SamplingParams, deadline: float | None, admission: Admission,
                     images: list[list] | None = None) -> Generation:
        """Start generating (post to the engine under `admission`): the async iterator of (prompt
        index, output). A disaggregated role (server/disagg.py) starts from another engine's KV instead."""
        if req.kv_transfer_params is not None:
            raise ApiError(400, "kv_transfer_params needs a server started with --role prefill or decode",
                           param="kv_transfer_params")
        return self.async_engine.generate(rid, prompts, params, deadline, images=images, admission=admission)

    # -- completions -----------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: CompletionRequest = parse(CompletionRequest, await self._json(request))
        self._check_model(req.model)
        reject_unsupported(req)
        prompts = await asyncio.to_thread(self._completion_prompts, req.prompt)
        params = sampling_params(req, req.max_tokens if req.max_tokens is not None else COMPLETIONS_MAX_TOKENS)
        await self._check_grammar(params, "response_format")
        self._check_fits(prompts, params, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        with self._admit(len(prompts) * params.n) as admission:
            outputs = await self._start(req, rid, [(p.text, p.ids) for p in prompts], params,
                                        self._deadline(arrival, req), admission)
        if req.stream:
            return _sse(self._stream_completion(rid, req, prompts, params, outputs), outputs)
        finals = await self._collect(request, outputs)
        choices = []
        for (pi, k), out in sorted(finals.items()):
            c = out.outputs[0]
            prefix = prompts[pi].text if req.echo else ""
            choices.append({"index": pi * params.n + k, "text": prefix + c.text, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                            "logprobs": completion_logprobs(self.tokenizer, c.logprobs, len(prefix))
                            if c.logprobs is not None else None})
        return JSONResponse({"id": rid, "object": "text_completion", "created": now(), "model": self.model_name,
                             "choices": choices, "usage": self._usage(prompts, finals)})

    def _stream_completion(self, rid: str, req: CompletionRequest, prompts: list[_Prompt], params: SamplingParams,
                           outputs) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}   # characters sent per choice (logprobs' text_offset)

        def choices(pi: int, c) -> list[dict]:
            idx = pi * params.n + c.index
            text = c.delta_text
            if req.echo and idx not in offsets:
                text = prompts[pi].text + text
            lp = None
            if c.delta_logprobs is not None:
                lp = completion_logprobs(self.tokenizer, c.delta_logprobs, offsets.get(idx, 0))
            offsets[idx] = offsets.get(idx, 0) + len(text)
            if not (text or c.finished or (lp and lp["tokens"])):
                return []
            return [{"index": idx, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason}]

        return self._stream(rid, "text_completion", req, prompts, outputs, choices)

    # -- chat ------------------------------------------------------------------------------------------
    def _chat_prompt(self, raw_messages: list, calling: ToolCalling | None = None) -> tuple[_Prompt, list]:
        """Messages -> the prompt through the chat template (tools offered as `calling` says), and its
        images in place. Decodes images and tokenises: called on a worker thread."""
        layout = self.engine.inputs.image_layout
        try:
            messages, urls = parse_chat(raw_messages, layout.placeholder if layout is not None else None)
            tools = None
            if calling is not None and calling.format is ToolFormat.NATIVE:
                tools = [t.openai() for t in calling.offered]
            elif calling is not None:
                messages = [ChatMessage("system", calling.preamble())] + messages
            images = self._chat_images(urls) if urls else []
            expand = (lambda text: expand_prompt(text, images, layout)) if urls else None
            ids = self.chat.encode(messages, expand, tools)
            items = place_images(ids, images, layout) if urls else []
        except UserInputError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return _Prompt(self.tokenizer.decode(ids, skip_special_tokens=False), ids), items

    def _tool_calling(self, req: ChatRequest) -> ToolCalling | None:
        calling = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tokenizer,
                              self.chat.renders_tools)
        if calling is not None and req.response_format is not None and req.response_format.get("type") not in (
                None, "text"):
            raise ApiError(400, "response_format cannot be combined with tools", param="response_format")
        return calling

    async def _check_grammar(self, params: SamplingParams, param: str) -> None:
        """Wait for the request's grammar, compiled on the grammars' worker threads (cached), so that
        a bad spec is a 400 before the request reaches the engine."""
        if params.structured_output is None:
            return
        try:
            grammar = await asyncio.to_thread(self.engine.grammars.submit, params.structured_output)
            await asyncio.wrap_future(grammar)
        except UserInputError as exc:
            raise ApiError(400, str(exc), param=param) from None

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: ChatRequest = parse(ChatRequest, await self._json(request))
        self._check_model(req.model)
        reject_unsupported(req)
        calling = self._tool_calling(req)
        prompt, items = await asyncio.to_thread(self._chat_prompt, req.messages, calling)
        ids = prompt.ids
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens; the messages take "
                                f"{len(ids)}", param="messages", code="context_length_exceeded")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, max_tokens if max_tokens is not None else limit - len(ids))
        if calling is not None:
            try:
                grammar = calling.structured_output()
            except ImportError:
                raise ApiError(400, INSTALL_HINT, param="tools") from None
            native = calling.format is ToolFormat.NATIVE   # its markers are special tokens: keep them to parse
            params = params.replace(structured_output=grammar, skip_special_tokens=params.skip_special_tokens and not native,
                                    stop=params.stop + ([TOOL_RESPONSE] if native else []))
        await self._check_grammar(params, "tools" if calling is not None else "response_format")
        self._check_fits([prompt], params, "messages", items)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        with self._admit(params.n) as admission:
            outputs = await self._start(req, rid, [(prompt.text, prompt.ids)], params, self._deadline(arrival, req),
                                        admission, images=[items])
        if req.stream:
            return _sse(self._stream_chat(rid, req, prompt, params, outputs, calling), outputs)
        finals = await self._collect(request, outputs)
        choices = []
        for (_, k), out in sorted(finals.items()):
            c = out.outputs[0]
            message, finish = _assistant_message(c, calling)
            choices.append({"index": k, "message": message, "finish_reason": finish, "stop_reason": c.stop_reason,
                            "logprobs": chat_logprobs(self.tokenizer, c.logprobs) if c.logprobs is not None else None})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now(), "model": self.model_name,
                             "choices": choices, "usage": self._usage([prompt], finals)})

    def _stream_chat(self, rid: str, req: ChatRequest, prompt: _Prompt, params: SamplingParams,
                     outputs, calling: ToolCalling | None = None) -> AsyncIterator[str]:
        """With tools offered, a choice's text is held until it finishes: whether it is a call is known
        only then (its content and calls come in one delta)."""
        def choices(_: int, c) -> list[dict]:
            out = []
            lp = chat_logprobs(self.tokenizer, c.delta_logprobs) if c.delta_logprobs else None
            finish = c.finish_reason
            if calling is None and (c.delta_text or lp):
                out.append({"index": c.index, "delta": {"content": c.delta_text}, "logprobs": lp,
                            "finish_reason": None})
            elif calling is not None and c.finished:
                message, finish = _assistant_message(c, calling)
                delta = {"content": message["content"]}
                if "tool_calls" in message:
                    delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]
                out.append({"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None})
            if c.finished:   # OpenAI closes each choice with an empty delta
                out.append({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish,
                            "stop_reason": c.stop_reason})
            return out

        opening = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for k in range(params.n)]
        return self._stream(rid, "chat.completion.chunk", req, [prompt], outputs, choices, opening)

    async def _stream(self, rid: str, kind: str, req: CompletionRequest | ChatRequest, prompts: list[_Prompt],
                      outputs, choices, opening: list[dict] = ()) -> AsyncIterator[str]:
        """Server-sent events: `opening` choices, then `choices(prompt index, completion output)` for
        every output, an error event if generation fails, the usage chunk if asked, and [DONE]."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = now()
        finals: dict[tuple[int, int], RequestOutput] = {}

        def chunk(choice: list[dict], **extra) -> str:
            body = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": choice,
                    **extra}
            if include_usage and "usage" not in body:
                body["usage"] = None
            return _event(body)

        for choice in opening:
            yield chunk([choice])
        async with contextlib.aclosing(outputs):
            try:
                async for pi, out in outputs:
                    c = out.outputs[0]
                    _raise_if_failed(c)
                    if c.finished:
                        finals[(pi, c.index)] = out
                    for choice in choices(pi, c):
                        yield chunk([choice])
            except (ApiError, EngineDeadError, UserInputError, DeadlineExceeded) as exc:
                err = _as_api_error(exc)
                self.metrics.http_errors.labels(str(err.status)).inc()   # counted like any other error
                yield _event(err.body())
                return
        if include_usage:
            yield chunk([], usage=self._usage(prompts, finals))
        yield "data: [DONE]\n\n"

    # -- shared ----------------------------------------------------------------------------------------
    async def _collect(self, request: Request, outputs) -> dict[tuple[int, int], RequestOutput]:
        """Every completion's final output, keyed (prompt index, completion index). Aborts the
        request if the client goes away while it runs."""
        finals: dict[tuple[int, int], RequestOutput] = {}

        async def consume() -> None:
            async with contextlib.aclosing(outputs):
                async for pi, out in outputs:
                    _raise_if_failed(out.outputs[0])
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
                raise _as_api_error(exc) from None
        finally:
            if not task.done():
                task.cancel()
        return finals

    def _usage(self, prompts: list[_Prompt], finals: dict[tuple[int, int], RequestOutput]) -> dict:
        completion = sum(len(o.outputs[0].token_ids) for o in finals.values())
        cached = sum({pi: o.num_cached_tokens for (pi, _), o in finals.items()}.values())
        return usage(sum(len(p.ids) for p in prompts), completion, cached)


def _assistant_message(c, calling: ToolCalling | None) -> tuple[dict, str | None]:
    """A finished completion -> (the assistant message, finish_reason): tool calls parsed out of the
    text when tools were offered ("tool_calls" then)."""
    if calling is None:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    content, calls = calling.parse(c.text)
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason


def _raise_if_failed(c) -> None:
    if c.finish_reason == "error":
        raise ApiError(500, f"internal error while generating: {c.error}", code="internal_error")


def _as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, UserInputError):   # the engine's own admission check (the handler's checks come first)
        return ApiError(400, str(exc))
    if isinstance(exc, DeadlineExceeded):
        return ApiError(408, str(exc), param="request_timeout", code="request_timeout")
    return ApiError(503, str(exc), code="engine_stopped")


class _TrackRequests:
    """ASGI middleware: keep `server.in_flight` (what a drain waits for), and count every /v1 request
    exactly once, when it ends, by the status it was answered with ("none" if the client left
    before any response), however it ended."""

    def __init__(self, app, server: OpenAIServer):
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = "none"

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        self.server.in_flight += 1
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.server.in_flight -= 1
            self.server.metrics.http_requests.labels(status).inc()


# -- the OpenAPI document (/openapi.json: what API fuzzers and client generators read) -------------------
_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ERRORS = {status: {"description": text, "content": {"application/json": {"schema": {
    "$ref": "#/components/schemas/Error"}}}}
    for status, text in ((400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
                         (408, "past the request's deadline"), (413, "body too large"), (429, "queue full"),
                         (499, "client closed the request"), (503, "loading, draining or stopped"))}


def _body(model: type) -> dict:
    """The request body schema of a route whose handler reads the raw body (validation is ours)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = _ERROR_SCHEMA
        for model in (CompletionRequest, ChatRequest):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        app.openapi_schema = schema
    return app.openapi_schema


def _parse_json(body: bytes) -> object:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"invalid JSON body: {exc}", code="invalid_json") from None


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
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


def _sse(events: AsyncIterator[str], outputs: Generation) -> StreamingResponse:
    return _EventStream(events, outputs, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


__all__ = ["OpenAIServer", "ServerConfig", "ServerState"]
