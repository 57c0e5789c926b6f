"""Which requests run in the next forward pass, and how many tokens each.

Every request catches its `num_computed_tokens` up to its `num_tokens`: a new prompt needs its whole
prompt (chunked to the token budget) minus what the prefix cache already holds, a decoding request
needs one token. Each step serves the
running requests first (in admission order), then admits waiting ones while the token budget, the
sequence limit and the KV pages allow. When pages run out, the most recently admitted running
request is preempted: its pages are freed, its tokens kept, and it is recomputed later, ahead of new
requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..kv.base import KVCacheManager
from .request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """True if this step brings the request up to date, so a token is sampled for it."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_pending_tokens, budget)
            if n == 0:  # cannot happen for an unfinished request; guard against a stall
                i += 1
                continue
            if self._allocate_or_preempt(req, n, out):
                out.seqs.append(ScheduledSeq(req, n))
                budget -= n
                i += 1
        # New (or preempted) requests only when nobody was preempted this step: otherwise the
        # pages just freed would go to a newcomer and the preempted request would starve.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            hit = self.kv.lookup(req.request_id, tokens)
            n = min(req.num_tokens - hit, budget)
            if not self.kv.allocate(req.request_id, tokens, hit, hit + n, prefill=True):
                break
            req.num_computed_tokens = hit
            req.num_cached_tokens += hit
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, n))
            budget -= n
        return out

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Pages for `n` more tokens of `req`, preempting later requests as needed. False if `req`
        itself had to be preempted."""
        start = req.num_computed_tokens
        while not self.kv.allocate(req.request_id, req.all_token_ids, start, start + n, prefill=n > 1):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
