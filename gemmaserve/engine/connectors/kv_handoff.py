"""Handing a prompt's KV from a prefill engine to a decode engine (the engine side; the HTTP side is
server/disagg.py, what moves is transfer/plan.py). Both sides are KV connectors in the step: the scheduler
side (here) puts the copies in the step description, and the runner makes them, so it stays the only
writer of its cache, and every tensor-parallel rank copies its own heads (transfer/kv_io.py).

Prefill (`PrefillHandoff`): a request marked for transfer runs as usual with max_tokens=1. The plan of
the step that completes its prompt asks the runner to save the prompt's KV rows after the forward (the
window tail of sliding layers, every token of full ones); rank 0 keeps them as one wire buffer, which the
step observer offers through the transfer runtime with the first sampled token. The request then
finishes and frees its pages as any other; while the staged buffer waits for a decode engine (until it
is released or the timeout expires) as many pool pages as it has bytes are held, so staged KV counts in
the engine's KV budget.

Decode (`DecodeHandoff`): `reserve` allocates the pages the next query reads through the engine's own
KV manager (`allocate_computed`), before any byte moves, so a full cache refuses at once; `adopt` gives
rank 0's runner the received bytes and the next plan the rows to load before its forward, enters the
blocks they fill whole into the prefix cache, moves the request straight to running with its prompt
computed, and commits the first token as the sample of a step computed elsewhere. The first decode step
is then exactly a single engine's: same KV, same token, so greedy output is identical. `cancel` frees a
reservation whose transfer failed.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from collections.abc import Callable

from ...errors import UserInputError
from ...kv.connector import StagedRows
from ...transfer.kv_io import row_spans, wire_bytes
from ...transfer.plan import TransferPlan, check_plan, plan_transfer, spec_signature
from ...transfer.runtime import TransferSource
from ..request import RequestOutput, TokenLogprob
from ..step import SeqStep, StepPlan, StepResult

if TYPE_CHECKING:   # the engine a connector attaches to sits above this room (ARCHITECTURE.md)
    from ..llm_engine import LLMEngine

log = logging.getLogger(__name__)


class NoKVRoom(RuntimeError):
    """The decode engine has no free pages for a transferred prompt now."""


@dataclass
class StagedTransfer:
    transfer_id: str
    prompt_token_ids: list[int]
    first_token: int
    first_logprob: TokenLogprob | None
    plan: TransferPlan
    nbytes: int
    source: dict           # what the runtime's offer returned: how a sink fetches it
    staged_at: float
    cached_tokens: int = 0   # prompt tokens the prefill engine's prefix cache served
    lora: str | None = None  # the adapter the KV was computed under (LoRARef.key: name and weights' digest)

    def describe(self, engine_info: dict) -> dict:
        lp = self.first_logprob
        return {"transfer_id": self.transfer_id, "prompt_token_ids": self.prompt_token_ids,
                "first_token": self.first_token, "cached_tokens": self.cached_tokens, "lora": self.lora,
                "first_logprob": None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]],
                "plan": self.plan.to_dict(), "nbytes": self.nbytes, "source": {**self.source, **engine_info}}


class _EngineConnector:
    """A connector of one engine. The engine holds it (its scheduler's connectors, its step observers), so it
    holds the engine weakly: a strong reference back would make a cycle that keeps a dropped engine, its model
    and KV cache, alive until the garbage collector happens to run."""

    def __init__(self, engine: LLMEngine):
        self._engine = weakref.ref(engine)

    @property
    def engine(self) -> LLMEngine:
        engine = self._engine()
        if engine is None:
            raise RuntimeError(f"the engine of this {type(self).__name__} is gone")
        return engine


class PrefillHandoff(_EngineConnector):
    """Stages the KV of requests marked for transfer; thread-safe (the engine thread stages, HTTP
    handlers describe and release). `post(fn)`: run fn on the engine thread (default: at once)."""

    def __init__(self, engine: LLMEngine, source: TransferSource, timeout: float, engine_id: str,
                 post: Callable[[Callable[[], None]], None] | None = None):
        super().__init__(engine)
        self.source = source
        self.timeout = timeout
        self.engine_id = engine_id
        self.signature = spec_signature(engine._kv.specs)
        self._post = post or (lambda fn: fn())
        self._expected: dict[str, str] = {}             # engine request id -> transfer id
        self._saving: dict[str, tuple[str, TransferPlan]] = {}   # request id -> (transfer id, plan): in a plan
        self._staged: dict[str, StagedTransfer] = {}
        self._lock = threading.Lock()
        self.bytes_staged = 0
        engine._scheduler.connectors.append(self)
        engine._step_observers.append(self._observe)

    def expect(self, request_id: str, transfer_id: str) -> None:
        with self._lock:
            if transfer_id in self._staged or transfer_id in self._expected.values():
                raise ValueError(f"transfer id {transfer_id!r} is already in use")
            self._expected[request_id] = transfer_id

    def forget(self, request_id: str) -> None:
        """The request ended; if it never staged (it failed or was aborted), stop waiting for it."""
        with self._lock:
            self._expected.pop(request_id, None)

    # -- the scheduler side (engine thread) --------------------------------------------------------
    def before_schedule(self) -> None:
        pass

    def describe(self, plan: StepPlan) -> None:
        """Ask the runner to save the KV of each marked request whose prompt this step completes."""
        with self._lock:
            if not self._expected:
                return
            wanted = {}
            for s in plan.seqs:
                tid = self._expected.get(s.req_id)
                if tid is None or not s.sample or s.num_drafts:
                    continue
                n = len(self.engine._request(s.req_id).prompt_token_ids)
                if s.start + s.num_new_tokens == n:
                    wanted[s.req_id] = (self._expected.pop(s.req_id), n)
        kv = self.engine._kv
        row_bytes = [s.head_dim * s.dtype.itemsize for s in kv.specs]
        for req_id, (tid, n) in wanted.items():
            tplan = plan_transfer(kv.groups, n)
            spans = row_spans(kv, req_id, tplan, self.engine._kv_heads)
            plan.kv_transfers.row_saves.append(StagedRows(tid, spans, wire_bytes(spans, row_bytes)))
            self._saving[req_id] = (tid, tplan)

    def _observe(self, plan: StepPlan, result: StepResult) -> None:
        """After the step ran: offer what it saved, with the first token (before the request finishes)."""
        if not self._saving:
            return
        sampled = dict(zip(result.req_ids, zip(result.token_ids, result.logprobs)))
        for rows in plan.kv_transfers.row_saves:
            req_id = next((r for r, (tid, _) in self._saving.items() if tid == rows.key), None)
            if req_id is None:
                continue
            tid, tplan = self._saving.pop(req_id)
            buffer = self.engine._runner.take_staged(tid)
            if buffer is None or req_id not in sampled:   # the step failed for it: nothing to hand over
                continue
            req = self.engine._request(req_id)
            token, logprob = sampled[req_id]
            # Staged KV counts in the KV budget: as many pool pages as it has bytes, until it goes.
            self.engine._kv.hold_pages(f"transfer:{tid}", -(-buffer.numel() // self.engine._kv.page_bytes))
            staged = StagedTransfer(tid, list(req.prompt_token_ids), token, logprob, tplan, buffer.numel(),
                                    self.source.offer(tid, buffer), time.monotonic(), req.num_cached_tokens,
                                    None if req.lora is None else req.lora.key)
            with self._lock:
                self._staged[tid] = staged
                self.bytes_staged += buffer.numel()

    # -- HTTP handlers ------------------------------------------------------------------------------
    def describe_transfer(self, transfer_id: str) -> dict | None:
        self.expire()
        with self._lock:
            staged = self._staged.get(transfer_id)
        if staged is None:
            return None
        return staged.describe({"engine": self.engine_id, "spec_signature": self.signature})

    def release(self, transfer_id: str) -> bool:
        with self._lock:
            staged = self._staged.pop(transfer_id, None)
        if staged is not None:
            self.source.withdraw(transfer_id)
            self._post(lambda: self.engine._kv.release_held(f"transfer:{transfer_id}"))
        return staged is not None

    def expire(self) -> int:
        """Release transfers no decode engine fetched within the timeout; returns how many."""
        cutoff = time.monotonic() - self.timeout
        with self._lock:
            old = [tid for tid, s in self._staged.items() if s.staged_at < cutoff]
        for tid in old:
            log.warning("KV transfer %s was not fetched within %.1fs: released", tid, self.timeout)
            self.release(tid)
        return len(old)

    @property
    def num_staged(self) -> int:
        with self._lock:
            return len(self._staged)


class DecodeHandoff(_EngineConnector):
    """Reservations of pages for incoming transfers. Every method runs on the engine thread."""

    def __init__(self, engine: LLMEngine):
        super().__init__(engine)
        self.signature = spec_signature(engine._kv.specs)
        self._reserved: dict[str, float] = {}   # request id -> when its pages were reserved
        self._loads: list[StagedRows] = []      # adopted, for the next plan
        engine._scheduler.connectors.append(self)

    def check_plan(self, plan: TransferPlan) -> str | None:
        """Why a transfer `plan` cannot fill this engine's KV layers, or None if it can (reads fixed geometry:
        any thread)."""
        return check_plan(plan, self.engine._kv.specs)

    def reserve(self, request_id: str, prompt_token_ids: list[int]) -> None:
        if not self.engine._kv.allocate_computed(request_id, prompt_token_ids, len(prompt_token_ids)):
            raise NoKVRoom(f"no free KV pages for a {len(prompt_token_ids)}-token prompt now")
        self._reserved[request_id] = time.monotonic()

    def cancel(self, request_id: str) -> None:
        if self._reserved.pop(request_id, None) is not None:
            self.engine._kv.free(request_id)

    def expire(self, max_age: float) -> int:
        """Free reservations older than `max_age` seconds (a request that never started: its client
        left before the response began). Returns how many."""
        cutoff = time.monotonic() - max_age
        old = [rid for rid, t in self._reserved.items() if t < cutoff]
        for rid in old:
            log.warning("KV reservation of request %s was never used: freed", rid)
            self.cancel(rid)
        return len(old)

    def adopt(self, engine: LLMEngine, request_id: str, plan: TransferPlan, buffer: torch.Tensor, first_token: int,
              first_logprob: TokenLogprob | None, cached_tokens: int = 0) -> list[RequestOutput]:
        why = self.check_plan(plan)   # (the HTTP side checks first; a Python caller may not)
        if why is not None:
            raise UserInputError(f"the transferred KV cannot serve this engine: {why}")
        if request_id not in self._reserved:
            raise RuntimeError(f"request {request_id} has no reserved pages")
        kv = engine._kv
        spans = row_spans(kv, request_id, plan, engine._kv_heads, receiving=True)
        nbytes = wire_bytes(spans, [s.head_dim * s.dtype.itemsize for s in kv.specs])
        if nbytes != buffer.numel():
            raise UserInputError(f"a transfer buffer of {buffer.numel()} bytes for a plan of {nbytes} bytes")
        del self._reserved[request_id]
        req = engine._request(request_id)
        engine._runner.put_staged(request_id, buffer)
        self._loads.append(StagedRows(request_id, spans, nbytes))
        kv.cache_computed(request_id, req.prompt_token_ids, req.block_hashes)   # copied before any later forward
        engine._scheduler.start_computed(req)
        req.num_cached_tokens = cached_tokens   # as the prefill engine's prefix cache served it
        step = StepPlan(-1, [SeqStep(request_id, plan.num_tokens, [], True)])
        return engine._commit_step(step, StepResult([request_id], [first_token], [first_logprob]))

    # -- the scheduler side --------------------------------------------------------------------------
    def before_schedule(self) -> None:
        pass

    def describe(self, plan: StepPlan) -> None:
        """Load what was adopted since the last plan, for requests that still hold their pages."""
        for rows in self._loads:
            if self.engine._kv.pages_held(rows.key):
                plan.kv_transfers.row_loads.append(rows)
            else:   # aborted before its first step: its pages are gone
                self.engine._runner.drop_staged(rows.key)
        self._loads = []

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)
