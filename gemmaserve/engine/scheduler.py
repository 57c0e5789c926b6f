"""Which requests run in the next forward pass, and how many tokens each.

Every request catches its `num_computed_tokens` up to its `num_tokens`: a new prompt needs its whole
prompt (chunked to the token budget) minus what the prefix cache already holds, a decoding request
needs one token. Each step, within `max_num_batched_tokens` and `max_num_seqs`:

  1. running decodes, least recently served first (so none starves if the budget is short), within
     three quarters of the budget while prompts wait (so decodes cannot starve them either);
  2. running prefills (chunks of prompts already admitted), in admission order;
  3. waiting requests, first come first served: preempted ones first (they are at the front), then
     new ones. A completion of an n > 1 group waits until its first sibling's prompt is cached, then
     reuses those KV pages through the prefix cache.

Admission looks ahead: while anything runs, a request is admitted only if the free pages cover what
the admitted prompts still need to finish their prefill, one step's transient pages, and its own
whole prompt, so prompts are not admitted only to be preempted half-way (with scratch a first chunk
is cheap, the rest of the prompt is not, and a preempted prompt is computed again). Decodes still grow into the free pages: when
pages run out, the most recently admitted running request is preempted: its pages are freed, its
tokens kept, and it is recomputed later (mostly from prefix-cache hits). No request is admitted in
a step that preempted one, so freed pages go back to the preempted, not to newcomers.
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
        self._step = 0
        self._admissions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        out = SchedulerOutput()
        decodes = sorted((r for r in self.running if r.prompt_computed and r.num_pending_tokens == 1),
                         key=lambda r: (r.last_served, r.admitted_order))
        prefills = [r for r in self.running if not (r.prompt_computed and r.num_pending_tokens == 1)]
        # Decodes go first but may not take the whole budget while prompts wait: a quarter stays
        # for prefill, so many decodes cannot starve a prompt (and round robin keeps every decode moving).
        reserve = max(1, self.max_num_batched_tokens // 4) if (prefills or self.waiting) else 0
        decode_budget = max(1, self.max_num_batched_tokens - reserve)
        used = 0
        for i, req in enumerate(decodes + prefills):
            if req.status is not RequestStatus.RUNNING:   # preempted earlier in this loop
                continue
            if i < len(decodes) and used >= decode_budget:
                continue
            if used >= self.max_num_batched_tokens:
                break
            n = self._chunk(req, req.num_pending_tokens, self.max_num_batched_tokens - used)
            preemptions = len(out.preempted)
            scheduled = self._allocate_or_preempt(req, n, out)
            if scheduled:
                out.seqs.append(ScheduledSeq(req, n))
            if len(out.preempted) != preemptions:   # a victim may have been scheduled earlier this step
                used = out.num_tokens
            elif scheduled:
                used += n
        if not out.preempted:
            self._admit(out, self.max_num_batched_tokens - out.num_tokens)
        for s in out.seqs:
            s.request.last_served = self._step
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_tokens - 1]
        owed = sum(self._prefill_growth(r) for r in prefilling)
        # One step's worth of transient pages on top (a chunk's sliding blocks before its commit
        # drops them): the token budget bounds what all of a step's chunks hold together.
        transient = max((self._step_transient(r) for r in prefilling), default=0)
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            sibling = req.wait_for
            if sibling is not None and not sibling.is_finished and not sibling.prompt_computed:
                continue  # its first sibling has not cached the shared prompt yet
            # Checked before the prefix lookup (which hashes the prompt): a blocked head of the queue
            # costs no hashing per step.
            transient = max(transient, self._step_transient(req))
            if self.running and self.kv.num_free_pages < owed + transient + self.kv.pages_at(req.num_tokens):
                return  # its prompt would later take pages an admitted prompt needs (or lack its own)
            tokens = req.all_token_ids
            hit = self.kv.lookup(req.request_id, tokens, req.block_hashes)
            n = self._chunk(req, req.num_tokens - hit, budget)
            if not self.kv.allocate(req.request_id, tokens, hit, hit + n, prefill=True, chain=req.block_hashes):
                return  # first come, first served: nobody overtakes a request that does not fit
            owed += self._prefill_growth(req, hit + n)
            self.waiting.remove(req)
            req.num_computed_tokens = hit
            if req.num_preemptions == 0:   # a resumed request's hits are its own recomputed blocks
                req.num_cached_tokens = hit
                self.kv.record_prefix_query(len(tokens) - 1, hit)
            req.status = RequestStatus.RUNNING
            req.admitted_order = self._admissions
            self._admissions += 1
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, n))
            budget -= n

    def _prefill_growth(self, req: Request, computed: int | None = None) -> int:
        """Pages `req` will still take until its prompt (all its tokens so far, for a resumed one)
        is computed: 0 once `computed` (default: its computed tokens) covers it."""
        if computed is None:
            computed = req.num_computed_tokens
        if computed >= req.num_tokens:
            return 0
        return max(0, self.kv.pages_at(req.num_tokens) - self.kv.pages_held(req.request_id))

    def _step_transient(self, req: Request) -> int:
        """Pages a prefill step of `req` holds beyond what the sequence keeps between steps (its
        remaining steps are no longer than what is left of its prompt)."""
        left = req.num_tokens - req.num_computed_tokens
        # Rounded up to a power of two (a larger step never holds fewer pages): a handful of distinct
        # (length, step) pairs per request, so the manager's memoised peak is not recomputed every step.
        chunk = min(1 << max(0, left - 1).bit_length(), req.max_chunk_tokens or self.max_num_batched_tokens)
        return max(0, self.kv.peak_pages(req.num_tokens, chunk) - self.kv.pages_at(req.num_tokens))

    @staticmethod
    def _chunk(req: Request, pending: int, budget: int) -> int:
        """Tokens to run for `req` this step: within the budget, and within its own chunk limit (a
        request that fits the KV cache only when prefilled in smaller chunks)."""
        n = min(pending, budget)
        return n if req.max_chunk_tokens is None else min(n, req.max_chunk_tokens)

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Pages for `n` more tokens of `req`, preempting the most recently admitted requests as
        needed. False if `req` itself had to be preempted."""
        start = req.num_computed_tokens
        while not self.kv.allocate(req.request_id, req.all_token_ids, start, start + n, prefill=n > 1):
            victim = max(self.running, key=lambda r: r.admitted_order)
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        out.seqs = [s for s in out.seqs if s.request is not req]   # it may have been scheduled already
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
