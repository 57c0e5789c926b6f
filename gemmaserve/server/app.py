"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`.

    POST /v1/completions        POST /v1/chat/completions     (JSON, or server-sent events with stream)
    POST /v1/audio/transcriptions, /v1/audio/translations     (multipart upload; models with an audio encoder)
    GET  /v1/models             GET  /health                  GET  /metrics (Prometheus text)
    POST /tokenize, /detokenize (vLLM's)
    POST /v1/responses, GET and DELETE /v1/responses/{id}     (OpenAI's Responses API, server/responses/)
    POST /v1/messages, /v1/messages/count_tokens                (Anthropic's Messages API: server/messages/)
    GET  /                      the chat page (chat_page.py: static/, a browser client of the routes above)

Each endpoint family is an object of its own module (serving_completion.py, serving_chat.py, serving_audio.py,
serving_lora.py, serving_models.py, serving_tokenize.py), composed with serving.py's shared request plumbing, which holds the
engine's client (client.py: handlers never touch the engine). This module builds them once the engine is
loaded, wires them to routes, and owns the app's lifecycle, authentication, errors, /health and /metrics.

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
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.llm_engine import LLMEngine
from ..engine.structured.structured_output import import_libraries
from ..engine.validation import CheckedRequest
from .async_engine import Admission, AsyncEngine, Generation
from .chat_page import add_chat_page
from .config import ServerConfig
from .messages.errors import ERROR_RESPONSES as _MESSAGES_ERRORS, error_body as messages_error, is_messages_path
from .messages.protocol import MESSAGES_MODELS, CountTokensRequest, MessagesRequest
from .messages.serving import MessagesServing
from .metrics import ServerMetrics
from .protocol import (
    ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, LoadLoRARequest, TokenizeRequest, TranscriptionRequest,
    UnloadLoRARequest, now,
)
from .serving import RETRY_AFTER_S, ServedModel, ServingCommon
from .serving_audio import AudioServing
from .serving_chat import ChatServing
from .serving_completion import CompletionServing
from .serving_lora import LoRAServing
from .serving_models import ModelsServing
from .serving_tokenize import TokenizeServing
from .responses.protocol import ResponsesRequest
from .responses.serving import ResponsesServing

log = logging.getLogger(__name__)


class ServerState(enum.Enum):
    LOADING = "loading"
    READY = "ok"
    DRAINING = "draining"
    FAILED = "failed"     # the engine did not load, or its thread died


@dataclass(frozen=True)
class Endpoints:
    """The endpoint objects of one loaded engine, each holding the shared plumbing and the engine's client."""
    completions: CompletionServing
    chat: ChatServing
    audio: AudioServing
    lora: LoRAServing
    models: ModelsServing
    tokenize: TokenizeServing
    responses: ResponsesServing
    messages: MessagesServing


class OpenAIServer:
    """Owns the app, its lifecycle, authentication and errors, and the routes every server has (health,
    metrics); each /v1 route forwards to its endpoint object (built when the engine is attached)."""

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
        """Build the engine's client and the endpoints over it. (A subclass gets the engine here, to attach
        engine-side collaborators: server/disagg.py.)"""
        # response_format and tools need the grammars' per-tokenizer state: built now (0.3 s for 262k
        # tokens once the libraries are imported, see _build_app) rather than by the first such request,
        # and before the server says ready, as doing it later would hold up /health for tenths of a second.
        try:
            engine.warm_up_grammars().result()
        except Exception as exc:   # a structured request will say what is missing; the rest is served
            log.warning("structured output is unavailable: %s", exc)
        self.async_engine = AsyncEngine(engine, self.metrics, self.config.max_queue_len)
        self.model = ServedModel.of(self.async_engine, self.config.served_model_name)
        self.common = ServingCommon(self.config, self.metrics, self.async_engine, self.model, self._start)
        lora = LoRAServing(self.common)
        chat = ChatServing(self.common)
        self.endpoints = Endpoints(CompletionServing(self.common), chat, AudioServing(self.common), lora,
                                   ModelsServing(self.common, lora, self.created), TokenizeServing(self.common, chat),
                                   ResponsesServing(self.common, chat), MessagesServing(chat))

    @property
    def model_name(self) -> str:
        return self.model.name

    async def _start(self, req: CompletionRequest | ChatRequest, rid: str, prompts: list[CheckedRequest],
                     deadline: float | None, admission: Admission) -> Generation:
        """How a request starts generating (`StartFn`): posted to this engine. A disaggregated role
        (server/disagg.py) starts from another engine's KV instead."""
        return await self.common.start_here(req, rid, prompts, deadline, admission)

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
            log.info("serving %s (chat: %s)", self.model_name, self.model.chat.source)

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
                log.info("serving %s (chat: %s)", self.model_name, self.model.chat.source)
            try:
                yield
            finally:
                if self.state is not ServerState.FAILED:
                    self.state = ServerState.DRAINING
                if hasattr(self, "async_engine"):
                    await asyncio.to_thread(self.async_engine.shutdown)

        app = FastAPI(title="gemmaserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
        v1 = APIRouter(prefix="/v1", dependencies=[Depends(self._authorize), Depends(self._require_ready)])
        to = self._route
        v1.add_api_route("/completions", to(lambda e: e.completions.completions), methods=["POST"],
                         openapi_extra=_body(CompletionRequest), responses=_ERRORS)
        v1.add_api_route("/chat/completions", to(lambda e: e.chat.chat_completions), methods=["POST"],
                         openapi_extra=_body(ChatRequest), responses=_ERRORS)
        for path, handler in (("/audio/transcriptions", to(lambda e: e.audio.transcriptions)),
                              ("/audio/translations", to(lambda e: e.audio.translations))):
            v1.add_api_route(path, handler, methods=["POST"], openapi_extra=_form_body(TranscriptionRequest),
                             responses=_ERRORS)
        v1.add_api_route("/models", self._models, methods=["GET"], responses=_ERRORS)
        v1.add_api_route("/load_lora_adapter", to(lambda e: e.lora.load_lora_adapter), methods=["POST"],
                         openapi_extra=_body(LoadLoRARequest), responses=_LORA_ERRORS)
        v1.add_api_route("/unload_lora_adapter", to(lambda e: e.lora.unload_lora_adapter), methods=["POST"],
                         openapi_extra=_body(UnloadLoRARequest), responses=_LORA_ERRORS)
        v1.add_api_route("/responses", to(lambda e: e.responses.create), methods=["POST"],
                         openapi_extra=_body(ResponsesRequest), responses=_ERRORS)
        for method, handler in (("GET", to(lambda e: e.responses.retrieve)),
                                ("DELETE", to(lambda e: e.responses.delete))):
            v1.add_api_route("/responses/{response_id}", handler, methods=[method], openapi_extra=_PATH_ID,
                             responses=_ERRORS)
        v1.add_api_route("/messages", to(lambda e: e.messages.create), methods=["POST"],
                         openapi_extra=_body(MessagesRequest), responses=_MESSAGES_ERRORS)
        v1.add_api_route("/messages/count_tokens", to(lambda e: e.messages.count_tokens), methods=["POST"],
                         openapi_extra=_body(CountTokensRequest), responses=_MESSAGES_ERRORS)
        app.include_router(v1)
        # vLLM's routes, outside /v1, behind the same key and readiness
        plain = APIRouter(dependencies=[Depends(self._authorize), Depends(self._require_ready)])
        plain.add_api_route("/tokenize", to(lambda e: e.tokenize.tokenize), methods=["POST"],
                            openapi_extra=_body(TokenizeRequest), responses=_ERRORS)
        plain.add_api_route("/detokenize", to(lambda e: e.tokenize.detokenize), methods=["POST"],
                            openapi_extra=_body(DetokenizeRequest), responses=_ERRORS)
        app.include_router(plain)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_text, methods=["GET"])
        add_chat_page(app)
        app.openapi = lambda: _openapi(app)
        app.add_middleware(_TrackRequests, server=self)
        app.add_exception_handler(ApiError, self._api_error)
        app.add_exception_handler(StarletteHTTPException, self._http_error)
        app.add_exception_handler(Exception, self._internal_error)
        return app

    def _error_response(self, err: ApiError, path: str = "") -> JSONResponse:
        self.metrics.http_errors.labels(str(err.status)).inc()
        body = messages_error(err) if is_messages_path(path) else err.body()   # each API's own error shape
        return JSONResponse(body, status_code=err.status, headers=err.headers)

    async def _api_error(self, request: Request, exc: ApiError) -> JSONResponse:
        return self._error_response(exc, request.url.path)

    async def _http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                            str(exc.detail))
        return self._error_response(ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404
                                             else None, headers=exc.headers), request.url.path)   # 405: Allow

    async def _internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return self._error_response(ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error"),
                                    request.url.path)

    async def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":   # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key: "
                                "<key>')", code="invalid_api_key")

    def _route(self, handler: Callable[[Endpoints], Callable[[Request], Awaitable[Response]]]):
        """A /v1 route's function: the endpoint's handler (the route's dependencies saw the server ready, so the
        endpoints exist)."""
        async def route(request: Request) -> Response:
            return await handler(self.endpoints)(request)
        return route

    async def _models(self) -> dict:
        return await self.endpoints.models.models()

    async def _engine_call(self, call: Awaitable):
        return await self.common.engine_call(call)

    async def _json(self, request: Request) -> object:
        return await self.common.read_json(request)

    # -- small routes ----------------------------------------------------------------------------------

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
            snap = await self._engine_call(self.async_engine.snapshot())
            return Response(self.metrics.render(snap, self.async_engine.integrity_ok), media_type=CONTENT_TYPE_LATEST)
        return Response(self.metrics.render(snap), media_type=CONTENT_TYPE_LATEST)


def _api_path(path: str) -> bool:
    """The routes that serve clients (not probes): /v1/*, and vLLM's /tokenize and /detokenize."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class _TrackRequests:
    """ASGI middleware: keep `server.in_flight` (what a drain waits for), and count every API request
    exactly once, when it ends, by the status it was answered with ("none" if the client left
    before any response), however it ended."""

    def __init__(self, app, server: OpenAIServer):
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not _api_path(scope["path"]):
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
_LORA_ERRORS = {**_ERRORS, **{status: {**_ERRORS[400], "description": text} for status, text in (
    (403, "run-time loading is off, or the path is outside --lora-root"), (409, "the adapter is in use"))}}


def _body(model: type) -> dict:
    """The request body schema of a route whose handler reads the raw body (validation is ours)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{model.__name__}"}}}}}


_PATH_ID = {"parameters": [{"name": "response_id", "in": "path", "required": True,   # (as the server makes them)
                            "schema": {"type": "string", "pattern": "^resp_[0-9a-f]{32}$"}}]}


def _form_body(model: type) -> dict:
    """A multipart upload's schema: the audio `file` and the model's fields (converted from text)."""
    js = model.model_json_schema()
    props = {"file": {"type": "string", "format": "binary"}, **js["properties"]}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file"], "properties": props}}}}}


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = _ERROR_SCHEMA
        for model in (CompletionRequest, ChatRequest, LoadLoRARequest, UnloadLoRARequest, TokenizeRequest,
                      DetokenizeRequest, ResponsesRequest, *MESSAGES_MODELS):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        app.openapi_schema = schema
    return app.openapi_schema


__all__ = ["OpenAIServer", "ServerConfig", "ServerState"]
