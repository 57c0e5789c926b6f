"""`gemmaserve router`: one OpenAI endpoint in front of prefill and decode engines (server/disagg.py
has the whole handshake and its diagram).

Per request: a fresh transfer id; the body goes to a prefill engine (not streamed, with the id),
then, once the prompt's KV is staged there, to a decode engine (with the id and the prefill
engine's URL), whose response (JSON or server-sent events) is piped back unchanged. The router
parses nothing but the body's JSON object: validation, templates and errors are the engines' own.

Faults: an engine that cannot be reached is skipped for a few seconds and the next one is tried;
a decode engine that is full (503 kv_cache_full) passes the request to the next decode engine
(the staged KV waits for it); a transfer that fails because the prefill engine died (502) starts
over on the next prefill engine. Anything else is answered with the engine's own OpenAI error, or
a 502 in OpenAI's format (an SSE error event once a stream has started).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .protocol import ApiError
from .router_config import RouterConfig

try:   # the same client, under the name this environment's openai package uses
    import httpx2 as httpx
except ImportError:   # pragma: no cover
    import httpx

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
SKIP_DOWN_S = 2.0          # an unreachable engine is skipped this long
_PASS_HEADERS = ("authorization",)


class _Pool:
    """Engines of one role, tried round robin, skipping those that just failed to answer."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self._next = itertools.count()
        self._down: dict[str, float] = {}

    def order(self) -> list[str]:
        start = next(self._next) % len(self.urls)
        ring = self.urls[start:] + self.urls[:start]
        now = time.monotonic()
        return [u for u in ring if self._down.get(u, 0) <= now] + [u for u in ring if self._down.get(u, 0) > now]

    def down(self, url: str) -> None:
        self._down[url] = time.monotonic() + SKIP_DOWN_S


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(ApiError(status, message, code=code).body(), status_code=status)


def _code(resp_body: bytes) -> str | None:
    try:
        return json.loads(resp_body)["error"]["code"]
    except Exception:
        return None


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.prefill = _Pool(config.prefill)
        self.decode = _Pool(config.decode)
        self.client: httpx.AsyncClient | None = None
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        import contextlib

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.request_timeout, connect=5.0))
            try:
                yield
            finally:
                await self.client.aclose()

        app = FastAPI(title="gemmaserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        return app

    async def completions(self, request: Request) -> Response:
        return await self._route(request, "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._route(request, "/v1/chat/completions")

    async def models(self, request: Request) -> Response:
        for url in self.decode.order():
            try:
                r = await self.client.get(url + "/v1/models", headers=self._headers(request))
            except httpx.TransportError:
                self.decode.down(url)
                continue
            return Response(r.content, r.status_code, media_type="application/json")
        return _error(503, "no decode engine is reachable", "no_engine")

    async def health(self) -> JSONResponse:
        status = {}
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            status[role] = {}
            for url in pool.urls:
                try:
                    r = await self.client.get(url + "/health", timeout=2.0)
                    status[role][url] = "ok" if r.status_code == 200 else r.json().get("status", str(r.status_code))
                except (httpx.TransportError, ValueError):
                    status[role][url] = "unreachable"
        ok = all(any(v == "ok" for v in status[role].values()) for role in status)
        return JSONResponse({"status": "ok" if ok else "degraded", **status}, status_code=200 if ok else 503)

    # -- one request ------------------------------------------------------------------------------------
    def _headers(self, request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in _PASS_HEADERS}

    async def _route(self, request: Request, path: str) -> Response:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return _error(413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes", "request_too_large")
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _error(400, f"invalid JSON body: {exc}", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_json")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params is set by the router, not by clients", "invalid_request")
        headers = self._headers(request)
        last: Response = _error(503, "no prefill engine is reachable", "no_engine")
        for prefill in self.prefill.order():
            tid = uuid.uuid4().hex
            staged = await self._prefill(prefill, path, body, tid, headers)
            if staged is None:
                continue                       # unreachable: the next prefill engine
            if staged.status_code != 200:
                return staged                  # the engine's own answer (bad request, overload, ...)
            last, retry = await self._decode(prefill, path, body, tid, headers, bool(body.get("stream")))
            if retry:
                log.warning("KV transfer from %s failed; trying the next prefill engine", prefill)
                self.prefill.down(prefill)
                continue
            return last
        return last

    async def _prefill(self, url: str, path: str, body: dict, tid: str, headers: dict) -> Response | None:
        sent = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        sent["kv_transfer_params"] = {"transfer_id": tid}
        try:
            r = await self.client.post(url + path, json=sent, headers=headers)
        except httpx.TransportError as exc:
            log.warning("prefill engine %s unreachable: %s", url, exc)
            self.prefill.down(url)
            return None
        return Response(r.content, r.status_code, media_type="application/json")

    async def _decode(self, prefill: str, path: str, body: dict, tid: str, headers: dict, stream: bool
                      ) -> tuple[Response, bool]:
        """The decode engine's response, and whether the transfer failed on the prefill side (retry there)."""
        sent = {**body, "kv_transfer_params": {"transfer_id": tid, "prefill_url": prefill}}
        answer: Response = _error(503, "no decode engine is reachable", "no_engine")
        for url in self.decode.order():
            try:
                resp = await self.client.send(self.client.build_request("POST", url + path, json=sent, headers=headers),
                                              stream=True)
            except httpx.TransportError as exc:
                log.warning("decode engine %s unreachable: %s", url, exc)
                self.decode.down(url)
                continue
            if resp.status_code != 200:
                content = await resp.aread()
                await resp.aclose()
                answer = Response(content, resp.status_code, media_type="application/json")
                code = _code(content)
                if code == "kv_cache_full":
                    continue                   # the staged KV waits: the next decode engine may have room
                return answer, code == "kv_transfer_failed" and resp.status_code == 502
            if stream:
                return StreamingResponse(self._pipe(resp, url), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}), False
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:
                return _error(502, f"decode engine {url} failed mid-response: {type(exc).__name__}",
                              "engine_failed"), False
            finally:
                await resp.aclose()
            return Response(content, 200, media_type="application/json"), False
        return answer, False

    async def _pipe(self, resp, url: str):
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            err = ApiError(502, f"decode engine {url} failed mid-stream: {type(exc).__name__}", code="engine_failed")
            yield f"data: {json.dumps(err.body())}\n\n".encode()
        finally:
            await resp.aclose()


def serve_router(config: RouterConfig) -> None:
    import uvicorn

    uvicorn.run(Router(config).app, host=config.host, port=config.port, log_level="info")
