"""The prefill and decode roles of `gemmaserve serve --role ...` (disaggregated serving).

Both roles are the OpenAI server (app.py) with one change: how a request starts (`_start`). The
router (router.py) gives each request a transfer id and sends it first to a prefill engine, then to
a decode engine, in `kv_transfer_params`; every check, template and response format stays the
ordinary server's.

    client          router                    prefill engine                      decode engine
      | POST /v1/... |                              |                                    |
      |------------->| body + {transfer_id}, no stream                                    |
      |              |----------------------------->| prompt computed, max_tokens=1      |
      |              |                              | step observer: KV window tail ->   |
      |              |                              |   staging buffer, offered (NIXL    |
      |              |<-----------------------------|   registration / torch: kept)      |
      |              | body + {transfer_id, prefill_url}                                 |
      |              |------------------------------------------------------------------>|
      |              |                              |<- GET /disagg/transfers/{id} ------| descriptor: prompt ids,
      |              |                              |                                    |  first token, plan, source
      |              |                              |                                    | reserve pages (own KV manager)
      |              |                              |<====== KV bytes ===================| nixl: one-sided READ
      |              |                              |   (torch: POST /disagg/control/send, then send/recv)
      |              |                              |<- DELETE /disagg/transfers/{id} ---| staging released
      |              |                              |                                    | scatter into pages, prompt
      |<=============|<=================== completion stream (SSE or JSON) ================|  computed, first token
      |              |                              |                                    |  committed, decode steps

Failures: a transfer that fails or passes --kv-transfer-timeout frees the decode engine's reserved
pages and answers 502/504 (OpenAI error JSON) before any byte of the response, so the router can
try another decode engine; a prefill engine frees what no decode engine fetched within the timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable

import torch
from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from ..config.kv_transfer import KVTransferConfig
from ..engine.connectors.kv_handoff import DecodeHandoff, NoKVRoom, PrefillHandoff
from ..engine.llm_engine import LLMEngine
from ..engine.request import TokenLogprob
from ..engine.validation import CheckedRequest
from ..transfer import make_sink, make_source
from ..transfer.plan import TransferPlan
from ..transfer.runtime import TransferTimeout
from .app import OpenAIServer
from .async_engine import Admission, Generation
from .config import ServerConfig
from .protocol import ApiError, ChatRequest, CompletionRequest

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TransferStats:
    transfers: int = 0
    failures: int = 0
    bytes: int = 0
    seconds: float = 0.0


class DisaggServer(OpenAIServer):
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], config: ServerConfig,
                 transfer: KVTransferConfig):
        if not transfer.disaggregated:
            raise ValueError("DisaggServer needs --role prefill or decode")
        self.transfer = transfer
        self.role = transfer.role
        self.engine_id = uuid.uuid4().hex
        self.stats = TransferStats()
        self.prefill: PrefillHandoff | None = None
        self.decode: DecodeHandoff | None = None
        self._stop = threading.Event()
        self._tasks: set[asyncio.Task] = set()
        super().__init__(engine, config)
        auth = [Depends(self._authorize)]
        self.app.add_api_route("/disagg/info", self.info, methods=["GET"], dependencies=auth)
        if self.role == "prefill":
            self.app.add_api_route("/disagg/transfers/{transfer_id}", self.describe, methods=["GET"], dependencies=auth)
            self.app.add_api_route("/disagg/transfers/{transfer_id}", self.release, methods=["DELETE"],
                                   dependencies=auth)
            self.app.add_api_route("/disagg/control/{op}", self.control, methods=["POST"], dependencies=auth)

    def _attach(self, engine: LLMEngine) -> None:
        super()._attach(engine)
        info = self.async_engine.info
        runtime, self._device = info.kv_transfer_runtime, torch.device(info.device)
        if self.role == "prefill":
            self.prefill = PrefillHandoff(engine, make_source(runtime, self._device), self.transfer.kv_transfer_timeout,
                                          self.engine_id, post=lambda fn: self.async_engine.post(lambda eng: fn()))
            threading.Thread(target=self._expire_loop, name="gemmaserve-kv-expiry", daemon=True).start()
        else:
            host = self.transfer.kv_transfer_host or self.config.host
            if host in ("0.0.0.0", "::", ""):
                host = socket.gethostname()
            self.sink = make_sink(runtime, self._device, host)
            self.decode = DecodeHandoff(engine)
            threading.Thread(target=self._expire_loop, name="gemmaserve-kv-expiry", daemon=True).start()
        log.info("%s engine %s: KV transfer runtime %s, KV manager %s", self.role, self.engine_id, runtime,
                 info.kv_manager)

    def _expire_loop(self) -> None:
        """Prefill: staged KV nobody fetched. Decode: reservations whose request never started (twice
        the timeout: a transfer in progress has given up by then)."""
        timeout = self.transfer.kv_transfer_timeout
        while not self._stop.wait(min(1.0, timeout / 4)):
            if self.prefill is not None:
                self.prefill.expire()
            elif self.async_engine.alive:
                self.async_engine.post(lambda eng: self.decode.expire(2 * timeout))

    # -- /disagg routes ------------------------------------------------------------------------------
    async def info(self) -> dict:
        self._current_state()
        out = {"role": self.role, "engine": self.engine_id, "state": self.state.value,
               "stats": dataclasses.asdict(self.stats)}
        if hasattr(self, "async_engine"):
            info = self.async_engine.info
            out.update(runtime=info.kv_transfer_runtime, kv_manager=info.kv_manager,
                       swa_scratch_reuse=info.swa_scratch_reuse, demotions=list(info.demotions))
        if self.state.value == "ok":
            out["kv"] = await self._engine_call(self.async_engine.call(_kv_health))
        if self.prefill is not None:
            out.update(staged=self.prefill.num_staged, bytes_staged=self.prefill.bytes_staged)
        return out

    async def describe(self, transfer_id: str) -> JSONResponse:
        await self._require_ready()
        desc = self.prefill.describe_transfer(transfer_id)
        if desc is None:
            raise ApiError(404, f"no staged KV transfer {transfer_id!r} (never staged, expired or released)",
                           code="transfer_not_found")
        return JSONResponse(desc)

    async def release(self, transfer_id: str) -> dict:
        await self._require_ready()
        return {"released": self.prefill.release(transfer_id)}

    async def control(self, op: str, request: Request) -> JSONResponse:
        await self._require_ready()
        body = await self._json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "a control request body must be a JSON object")
        try:
            reply = await asyncio.to_thread(self.prefill.source.handle, op, body, self.transfer.kv_transfer_timeout)
        except (KeyError, ValueError) as exc:
            raise ApiError(404 if isinstance(exc, KeyError) else 400, str(exc).strip("'\""), code="transfer_error")
        except TransferTimeout as exc:
            raise ApiError(504, str(exc), code="kv_transfer_timeout") from None
        except RuntimeError as exc:
            raise ApiError(502, str(exc), code="kv_transfer_failed") from None
        return JSONResponse(reply)

    # -- how a request starts -----------------------------------------------------------------------
    async def _start(self, req: CompletionRequest | ChatRequest, rid: str, prompts: list[CheckedRequest],
                     deadline: float | None, admission: Admission) -> Generation:
        tp = req.kv_transfer_params
        if tp is None:
            raise ApiError(400, f"this is a {self.role} engine: send requests through `gemmaserve router` "
                                "(kv_transfer_params missing)", param="kv_transfer_params")
        tid = tp.transfer_id
        if not isinstance(tid, str) or not tid or len(tid) > 128:
            raise ApiError(400, "kv_transfer_params.transfer_id must be a non-empty string",
                           param="kv_transfer_params")
        if len(prompts) != 1 or prompts[0].params.n != 1:
            raise ApiError(400, "disaggregated serving takes one prompt and n=1 per request", param="prompt")
        gid = f"{rid}-0"   # AsyncEngine's engine id for prompt 0
        if self.role == "prefill":
            return self._prefill(rid, gid, tid, prompts[0], deadline, admission)
        url = tp.prefill_url
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ApiError(400, "kv_transfer_params.prefill_url must be an http(s) URL", param="kv_transfer_params")
        return await self._decode(rid, gid, tid, url.rstrip("/"), prompts[0], deadline, admission)

    def _prefill(self, rid: str, gid: str, tid: str, checked: CheckedRequest, deadline: float | None,
                 admission: Admission) -> Generation:
        try:
            self.prefill.expect(gid, tid)
        except ValueError as exc:
            raise ApiError(409, str(exc), param="kv_transfer_params", code="transfer_id_in_use") from None
        try:
            # the prompt's KV and its first token only (the checks covered the whole request)
            first = dataclasses.replace(checked, params=checked.params.replace(max_tokens=1))
            outputs = self.async_engine.generate(rid, [first], deadline, admission=admission)
        except BaseException:
            self.prefill.forget(gid)
            raise
        outputs.on_end(lambda: self.prefill.forget(gid))
        return outputs

    async def _decode(self, rid: str, gid: str, tid: str, url: str, checked: CheckedRequest, deadline: float | None,
                      admission: Admission) -> Generation:
        started = time.perf_counter()
        desc = await asyncio.to_thread(self._call, url, "GET", f"/disagg/transfers/{tid}")
        ids = checked.prompt_ids
        if desc["prompt_token_ids"] != ids:
            raise ApiError(400, "the prompt differs from the one the prefill engine computed (another tokenizer "
                                "or chat template?)", param="kv_transfer_params", code="transfer_mismatch")
        if desc["source"]["spec_signature"] != self.decode.signature:
            raise ApiError(400, "the prefill engine's KV layout (layers, heads, dtype) differs from this engine's: "
                                "serve the same model with the same --kv-cache-dtype (and the same draft model, "
                                "whose KV layers travel with the target's)", code="transfer_mismatch")
        ours = next((r.key for r in self.async_engine.adapter_refs() if r.name == checked.lora), None)
        if desc.get("lora") != ours:   # KV computed under another adapter (or another version of it) is not ours
            raise ApiError(400, f"the prefill engine computed this prompt under adapter "
                                f"{desc.get('lora') or 'none'}, this request runs under {ours or 'none'} (name@digest): "
                                "serve the same adapters on both roles", param="model", code="transfer_mismatch")
        plan = TransferPlan.from_dict(desc["plan"])
        why = self.decode.check_plan(plan)
        if why is not None:
            raise ApiError(400, f"the transferred KV cannot serve this engine: {why}", code="transfer_mismatch")
        try:
            await self.async_engine.call(lambda eng: self.decode.reserve(gid, ids))
            buffer = await asyncio.to_thread(
                self.sink.receive, desc["source"], tid, int(desc["nbytes"]), self._device,
                self.transfer.kv_transfer_timeout, lambda op, body: self._call(url, "POST", f"/disagg/control/{op}", body))
        except NoKVRoom as exc:   # the staged KV stays: the router may try another decode engine
            raise ApiError(503, str(exc), code="kv_cache_full") from None
        except BaseException as exc:   # cancelled too (the client left): the reservation goes
            self.async_engine.post(lambda eng: self.decode.cancel(gid))
            self._background(self._release, url, tid)
            self.stats.failures += 1
            if isinstance(exc, TransferTimeout):
                raise ApiError(504, str(exc), code="kv_transfer_timeout") from None
            if isinstance(exc, Exception):
                log.warning("KV transfer %s failed: %s", tid, exc)
                raise ApiError(502, f"KV transfer from the prefill engine failed: {exc}",
                               code="kv_transfer_failed") from None
            raise
        self._background(self._release, url, tid)
        self.stats.transfers += 1
        self.stats.bytes += buffer.numel()
        self.stats.seconds += time.perf_counter() - started
        lp = desc.get("first_logprob")
        first_lp = None if lp is None else TokenLogprob(lp[0], lp[1], tuple(tuple(t) for t in lp[2]))

        def cancel() -> None:   # frees the reservation if the request never reached `adopt` (a no-op otherwise)
            self.async_engine.post(lambda eng: self.decode.cancel(gid))

        try:
            outputs = self.async_engine.generate(
                rid, [checked], deadline, admission=admission,
                adopt=lambda eng, g: self.decode.adopt(eng, g, plan, buffer, desc["first_token"], first_lp,
                                                       int(desc.get("cached_tokens", 0))))
        except BaseException:
            cancel()
            raise
        outputs.on_end(cancel)
        return outputs

    # -- talking to the prefill engine ----------------------------------------------------------------
    def _background(self, fn, *args) -> None:
        """Run fn(*args) on a worker thread; the task is kept until it ends (asyncio holds tasks weakly)."""
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(fn, *args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _call(self, base: str, method: str, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(base + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.transfer.kv_transfer_timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except Exception:
                message = f"HTTP {exc.code}"
            status = 404 if exc.code == 404 else 502
            raise ApiError(status, f"prefill engine {base}: {message}", code="kv_transfer_failed") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ApiError(502, f"prefill engine {base} unreachable: {exc}", code="kv_transfer_failed") from None

    def _release(self, base: str, tid: str) -> None:
        try:
            self._call(base, "DELETE", f"/disagg/transfers/{tid}")
        except ApiError as exc:   # the prefill engine's timeout frees it anyway
            log.info("could not release KV transfer %s: %s", tid, exc.message)


def _kv_health(engine: LLMEngine) -> dict:
    """Pages by state, and whether the KV manager's bookkeeping holds (what fault tests look at)."""
    st = engine.snapshot()
    try:
        for _ in engine.kv_integrity_steps():
            pass
        ok = True
    except AssertionError:
        ok = False
    return {"num_pages": st.pages_total, "pages_used": st.pages_used, "pages_cached": st.pages_cached,
            "pages_free": st.pages_free, "integrity": ok, "running": engine.has_unfinished_requests()}


def serve_role(engine: Callable[[], LLMEngine], config: ServerConfig, transfer: KVTransferConfig) -> None:
    """`gemmaserve serve --role prefill|decode`."""
    from .runner import make_server

    api = DisaggServer(engine, config, transfer)
    try:
        make_server(api, config.host, config.port).run()
    finally:
        api._stop.set()
    if api.load_error is not None:
        raise api.load_error
