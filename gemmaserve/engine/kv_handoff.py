"""Handing a prompt's KV from a prefill engine to a decode engine (the engine side; the HTTP side is
server/disagg.py, what moves is transfer/plan.py).

Prefill (`PrefillHandoff`): a request marked for transfer runs as usual with max_tokens=1. When the
step that completes its prompt has run, and before it is committed (its pages still held), the
engine's step observer copies the plan's KV into a staging buffer, offers it through the transfer
runtime, and keeps the first sampled token with it. The request then finishes and frees its pages
as any other; the staged buffer lives until the decode engine releases it or the timeout expires.

Decode (`DecodeHandoff`): `reserve` allocates the pages the next query reads through the engine's
own KV manager (`allocate_computed`), before any byte moves, so a full cache refuses at once;
`adopt` writes the received bytes into those pages, moves the request straight to running with its
prompt computed, and commits the first token as the sample of a step computed elsewhere. The first
decode step is then exactly a single engine's: same KV, same token, so greedy output is identical.
`cancel` frees a reservation whose transfer failed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from ..transfer.kv_io import scatter, gather
from ..errors import UserInputError
from ..transfer.plan import TransferPlan, check_plan, plan_transfer, spec_signature
from ..transfer.runtime import TransferSource
from .llm_engine import LLMEngine
from .request import RequestOutput, TokenLogprob
from .step import SeqStep, StepPlan, StepResult

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

    def describe(self, engine_info: dict) -> dict:
        lp = self.first_logprob
        return {"transfer_id": self.transfer_id, "prompt_token_ids": self.prompt_token_ids,
                "first_token": self.first_token,
                "first_logprob": None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]],
                "plan": self.plan.to_dict(), "nbytes": self.nbytes, "source": {**self.source, **engine_info}}


class PrefillHandoff:
    """Stages the KV of requests marked for transfer; thread-safe (the engine thread stages, HTTP
    handlers describe and release)."""

    def __init__(self, engine: LLMEngine, source: TransferSource, timeout: float, engine_id: str):
        self.engine = engine
        self.source = source
        self.timeout = timeout
        self.engine_id = engine_id
        self.signature = spec_signature(engine.kv.specs)
        self._expected: dict[str, str] = {}             # engine request id -> transfer id
        self._staged: dict[str, StagedTransfer] = {}
        self._lock = threading.Lock()
        self.bytes_staged = 0
        engine.step_observers.append(self._observe)

    def expect(self, request_id: str, transfer_id: str) -> None:
        with self._lock:
            if transfer_id in self._staged or transfer_id in self._expected.values():
                raise ValueError(f"transfer id {transfer_id!r} is already in use")
            self._expected[request_id] = transfer_id

    def forget(self, request_id: str) -> None:
        """The request ended; if it never staged (it failed or was aborted), stop waiting for it."""
        with self._lock:
            self._expected.pop(request_id, None)

    def _observe(self, plan: StepPlan, result: StepResult) -> None:
        with self._lock:
            if not self._expected:
                return
            wanted = {s.req_id: self._expected.pop(s.req_id) for s in plan.seqs
                      if s.sample and s.req_id in self._expected and s.req_id in result.req_ids}
        sampled = dict(zip(result.req_ids, zip(result.token_ids, result.logprobs)))
        for req_id, tid in wanted.items():
            req = self.engine.request(req_id)
            n = len(req.prompt_token_ids)
            tplan = plan_transfer(self.engine.kv.groups, n)
            buffer = gather(self.engine.runner.kv_cache, self.engine.kv, req_id, tplan)
            token, logprob = sampled[req_id]
            staged = StagedTransfer(tid, list(req.prompt_token_ids), token, logprob, tplan, buffer.numel(),
                                    self.source.offer(tid, buffer), time.monotonic())
            with self._lock:
                self._staged[tid] = staged
                self.bytes_staged += buffer.numel()

    def describe(self, transfer_id: str) -> dict | None:
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


class DecodeHandoff:
    """Reservations of pages for incoming transfers. Every method runs on the engine thread."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.signature = spec_signature(engine.kv.specs)
        self._reserved: dict[str, float] = {}   # request id -> when its pages were reserved

    def reserve(self, request_id: str, prompt_token_ids: list[int]) -> None:
        if not self.engine.kv.allocate_computed(request_id, prompt_token_ids, len(prompt_token_ids)):
            raise NoKVRoom(f"no free KV pages for a {len(prompt_token_ids)}-token prompt now")
        self._reserved[request_id] = time.monotonic()

    def cancel(self, request_id: str) -> None:
        if self._reserved.pop(request_id, None) is not None:
            self.engine.kv.free(request_id)

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
              first_logprob: TokenLogprob | None) -> list[RequestOutput]:
        why = check_plan(plan, engine.kv.specs)   # (the HTTP side checks first; a Python caller may not)
        if why is not None:
            raise UserInputError(f"the transferred KV cannot serve this engine: {why}")
        if self._reserved.pop(request_id, None) is None:
            raise RuntimeError(f"request {request_id} has no reserved pages")
        req = engine.request(request_id)
        scatter(engine.runner.kv_cache, engine.kv, request_id, plan, buffer)
        engine.scheduler.start_computed(req)
        step = StepPlan(-1, [SeqStep(request_id, plan.num_tokens, [], True)])
        return engine.commit_step(step, StepResult([request_id], [first_token], [first_logprob]))

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)
