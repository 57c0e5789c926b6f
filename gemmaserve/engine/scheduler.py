"""Which requests run in the next forward pass, and how many tokens each.

Every request catches its `num_computed_tokens` up to its `num_tokens`: a new prompt needs its whole
prompt (chunked to the token budget) minus what the prefix cache already holds, a decoding request
needs one token. Each step, within `max_num_batched_tokens` and `max_num_seqs`:

  1. running decodes, least recently served first (so none starves if the budget is short), within
     three quarters of the budget while prompts wait (so decodes cannot starve them either);
  2. running prefills (chunks of prompts already admitted), in admission order;
  3. waiting requests, first come first served: preempted ones first (they are at the front), then
     new ones. A completion of an n > 1 group waits until its first sibling's prompt is cached, then
     reuses those KV pages through the prefix cache; a structured request waits (overtaken) until its
     grammar is compiled.

Admission looks ahead: while anything runs, a request is admitted only if the free pages cover what
the admitted prompts still need to finish their prefill, one step's transient pages, and its own
whole prompt, so prompts are not admitted only to be preempted half-way (with scratch a first chunk
is cheap, the rest of the prompt is not, and a preempted prompt is computed again). Decodes still grow into the free pages: when
pages run out, the most recently admitted running request is preempted: its pages are freed, its
tokens kept, and it is recomputed later (mostly from prefix-cache hits). No request is admitted in
a step that preempted one, so freed pages go back to the preempted, not to newcomers.

Speculative decoding (a `Proposer`): a decode runs its last token and up to k drafted guesses at the
tokens after it; the runner keeps the longest run of guesses the target agrees with, plus the target's
own next token. Only those tokens' KV is committed: the rejected drafts' positions are computed again
the next step (no KV policy drops a block a query at the committed position reads). A request whose
speculative step is still in flight is not scheduled again until its tokens are known. Drafts take
only free pages. A request whose drafts were all rejected MISSES_BEFORE_PAUSE steps in a row stops
drafting for a while (8 steps, doubling while it keeps missing, up to 256): a drafter that guesses
nothing for a text costs a drafting step's price every step (1.5-1.9x a plain one for the tiny CPU
models of BENCHMARKS.md).

LoRA adapters: a waiting request is admitted only while the running requests use at most --max-loras
adapters with its own (others go ahead of it meanwhile); each step names every sequence's adapter slot and the
slot loads the runner does first (engine/lora.py).

The scheduler owns request and KV state: `schedule()` decides and allocates, then describes the step
as plain data (`StepPlan`: tokens per request, block-table deltas, new slots, requests gone), and
`update_from_output()` alone commits the step (KV commit, sampled tokens, stop checks, finishing).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..kv.base import KVCacheManager
from .spec_decode.proposers import Proposer
from .request import FinishReason, Request, RequestStatus
from .step import DEVICE_TOKEN, NewRequest, SeqStep, SlotUpdate, StepPlan, StepResult, TableDelta

if TYPE_CHECKING:
    from .lora import LoRASlots

class SchedulerConnector(Protocol):
    def before_schedule(self) -> None:
        """On the engine thread, before a step is scheduled (take back what no longer needs pages)."""

    def describe(self, plan: StepPlan) -> None:
        """Add this step's copies to its plan (`plan.kv_transfers`)."""


MISSES_BEFORE_PAUSE = 4
FIRST_PAUSE, LONGEST_PAUSE = 8, 256   # steps


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int                 # drafts included
    drafts: list[int] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        """True if this step brings the request up to date, so a token is sampled for it."""
        return self.request.num_computed_tokens + self.num_new_tokens - len(self.drafts) == self.request.num_tokens


@dataclass
class _Decision:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


@dataclass
class SpecStats:
    """Speculative decoding counters (users read them: /metrics, --json, benchmarks)."""

    steps: int = 0                      # sequence steps that carried drafts
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)   # [i]: steps whose draft i was accepted
    drafted_at: list[int] = field(default_factory=list)    # [i]: steps that drafted position i

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculative step emitted on average: accepted drafts + the target's own."""
        return 1 + self.accepted / self.steps if self.steps else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        for counts, n in ((self.drafted_at, drafted), (self.accepted_at, accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 proposer: Proposer | None = None, spec_max_batch: int = 1 << 30, lora_slots: LoRASlots | None = None):
        """`spec_max_batch`: steps with more running decodes draft nothing (speculation stops paying).
        `lora_slots`: the device slots of LoRA adapters (engine/lora.py); None without adapters."""
        self.kv = kv
        self.lora_slots = lora_slots
        self.proposer = proposer
        self.spec_max_batch = spec_max_batch
        self.spec_stats = SpecStats()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._step = 0
        self._admissions = 0
        self._by_id: dict[str, Request] = {}
        self._released: list[str] = []     # preempted since the last plan: the runner drops their tables
        self._finished: list[str] = []     # finished since the last plan: and their sampling state
        self._slot_cursors = [-1] * len(kv.groups)
        # The scheduler side of KV connectors outside the KV manager (kv_handoff.py): each sees every step first
        # and adds its copies to the plan last.
        self.connectors: list[SchedulerConnector] = []
        self._uncommitted: list[tuple[Request, int]] = []   # (request, end) scheduled, KV not committed yet
        self._proposing = False   # this step asks the runner for drafts (a runner-side proposer, batch small enough)
        self.misses_before_pause = MISSES_BEFORE_PAUSE   # (a benchmark that times drafting steps turns it off)

    def add(self, request: Request) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id} is already scheduled")
        self._by_id[request.request_id] = request
        self.waiting.append(request)

    def start_computed(self, request: Request) -> None:
        """Run a waiting request whose prompt was computed elsewhere (a disaggregated prefill engine):
        its pages are allocated (`KVCacheManager.allocate_computed`) and filled, and its first token
        is a sample in flight, which `update_from_output` commits."""
        self.waiting.remove(request)
        request.num_computed_tokens = len(request.prompt_token_ids)
        request.num_pending_samples += 1
        request.status = RequestStatus.RUNNING
        request.admitted_order = self._admissions
        self._admissions += 1
        self.running.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        self._step += 1
        for connector in self.connectors:
            connector.before_schedule()
        self._commit_ready()   # the step in flight (asynchronous scheduling) frees its stale blocks first
        out = _Decision()
        decodes = sorted((r for r in self.running if r.prompt_computed and r.num_pending_tokens == 1
                          and not self._finishing(r)), key=lambda r: (r.last_served, r.admitted_order))
        drafting = self.proposer is not None and len(decodes) <= self.spec_max_batch
        self._proposing = drafting and self.proposer.drafts_after_step
        if drafting:
            # A request that drafts waits for its last token (asynchronous scheduling: still in flight), and the
            # drafting requests wait together: scheduling those whose token is in while the others' is not
            # splits them into two groups verifying in alternate steps, each at half the tokens per forward
            # (measured: 2.0 instead of 4.0 at k = 3, batch 8, every draft right).
            if any(r.num_pending_samples and self._drafts_for(r) for r in decodes):
                decodes = [r for r in decodes if not self._drafts_for(r)]
        prefills = [r for r in self.running if not (r.prompt_computed and r.num_pending_tokens <= 1)]
        # Decodes go first but may not take the whole budget while prompts wait: a quarter stays
        # for prefill, so many decodes cannot starve a prompt (and round robin keeps every decode moving).
        reserve = max(1, self.max_num_batched_tokens // 4) if (prefills or self.waiting) else 0
        # A prefill whose next chunk starts with an image or clip needs all of it in one step: decodes
        # leave room for it (all of the budget if need be, for that step).
        item = max((it.length for r in prefills for it in r.media if it.start == r.num_computed_tokens), default=0)
        reserve = min(self.max_num_batched_tokens, max(reserve, item))
        decode_budget = max(0 if item else 1, self.max_num_batched_tokens - reserve)
        used = 0
        for i, req in enumerate(decodes + prefills):
            if req.status is not RequestStatus.RUNNING:   # preempted earlier in this loop
                continue
            if i < len(decodes) and used >= decode_budget:
                continue
            if used >= self.max_num_batched_tokens:
                break
            n = self._chunk(req, req.num_computed_tokens, req.num_pending_tokens, self.max_num_batched_tokens - used)
            if n == 0:   # an image or clip that does not fit what is left of the budget: next step
                continue
            drafts = []
            if i < len(decodes) and drafting:
                room = min(self.max_num_batched_tokens - used, decode_budget - used) - 1
                drafts = self._drafts(req, room)
                # Drafts take only free pages: they never preempt anyone (nor leave a lone request unable to run).
                if drafts and not self.kv.allocate(req.request_id, req.cache_token_ids, req.num_computed_tokens,
                                                   req.num_computed_tokens + n + len(drafts), prefill=False):
                    drafts = []
                n += len(drafts)
            preemptions = len(out.preempted)
            scheduled = bool(drafts) or self._allocate_or_preempt(req, n, out, prefill=n > 1)
            if scheduled:
                out.seqs.append(ScheduledSeq(req, n, drafts))
            if len(out.preempted) != preemptions:   # a victim may have been scheduled earlier this step
                used = out.num_tokens
            elif scheduled:
                used += n
        if not out.preempted:
            self._admit(out, self.max_num_batched_tokens - out.num_tokens)
        for s in out.seqs:
            s.request.last_served = self._step
        return self._describe(out)

    def _active_adapters(self) -> set[str]:
        """The LoRA adapters (keys) of the running requests."""
        return {r.lora.key for r in self.running if r.lora is not None}

    def _drafts(self, req: Request, room: int) -> list[int]:
        """Guesses at `req`'s next tokens: within `room` (budget), the request's own limits (a token
        past max_tokens or max_model_len is never emitted) and its opt-out."""
        if not self._drafts_for(req) or room <= 0 or req.num_pending_samples:
            return []
        limit = min(room, req.params.max_tokens - len(req.output_token_ids) - 1,
                    req.max_total_tokens - req.num_tokens - 1)
        return self.proposer.propose(req, limit) if limit > 0 else []

    def _drafts_for(self, req: Request, step: int | None = None) -> bool:
        """`req` drafts at `step` (default: this one): it did not opt out and is not pausing."""
        return req.params.speculative and (self._step if step is None else step) >= req.drafts_resume_at

    # -- the step as data ----------------------------------------------------------------------
    def _describe(self, out: _Decision) -> StepPlan:
        plan = StepPlan(self._step, released=self._released, finished=self._finished)
        self._released, self._finished = [], []
        adapters = self._active_adapters() if self.lora_slots is not None else set()
        for s in out.seqs:
            req = s.request
            lora_slot = -1
            if req.lora is not None:
                lora_slot, load = self.lora_slots.slot_for(req.lora, adapters)
                if load is not None:
                    plan.lora_loads.append(load)
            if not req.sampling_sent:
                plan.new_requests.append(NewRequest(req.request_id, req.params, req.seed, req.prompt_token_ids,
                                                    req.media, list(req.output_token_ids)))
                req.sampling_sent = True
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            deltas, new_table = self._table_deltas(req)
            real = end - len(s.drafts)
            known = req.all_token_ids[start:real]   # beyond: sampled by the step in flight, still on the device
            propose = self.proposer.num_speculative_tokens if (
                self._proposing and s.completes and self._drafts_for(req, self._step + 1)) else 0
            plan.seqs.append(SeqStep(req.request_id, start,
                                     known + [DEVICE_TOKEN] * (real - start - len(known)) + s.drafts,
                                     s.completes, deltas, new_table, len(s.drafts), propose, lora_slot))
            req.drafts = []   # used (or outdated: this step's token gets new ones)
            if s.completes:
                req.num_pending_samples += 1
            req.num_computed_tokens = end
            self._uncommitted.append((req, end))
        plan.kv_transfers = self.kv.take_transfers() or plan.kv_transfers
        for connector in self.connectors:   # after the KV manager's copies: a handoff loads into pages they free
            connector.describe(plan)
        for g, cursor in enumerate(self._slot_cursors):
            rows, self._slot_cursors[g] = self.kv.slot_changes(g, cursor)
            if rows is None or rows:   # None: the log moved on without us; resend every live row
                rows, pages = self.kv.slot_rows(g, None if rows is None else sorted(set(rows)))
                if rows:
                    plan.slot_updates.append(SlotUpdate(g, rows, pages))
        return plan

    def _table_deltas(self, req: Request) -> tuple[list[TableDelta] | None, bool]:
        """What changed in `req`'s block tables since the runner last saw them (all of them if it
        holds none): tables only drop blocks at the front and append at the end."""
        current = [self.kv.block_table(req.request_id, g) for g in range(len(self._slot_cursors))]
        sent = req.sent_tables
        req.sent_tables = [(first, first + len(rows)) for first, rows in current]
        if sent is None:
            return [TableDelta(first, list(rows)) for first, rows in current], True
        if req.sent_tables == sent:
            return None, False
        return [TableDelta(first, rows[max(0, end - first):]) for (first, rows), (_, end) in zip(current, sent)], False

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Commit a step: its KV (blocks cached, stale blocks freed), sampled token ids (stop token,
        end-of-sequence and length checks), finished requests (pages freed). Returns the requests that
        sampled, failed or finished, in plan order. With asynchronous scheduling the next plan is already
        out: a request it scheduled that finishes here simply ignores that step's result."""
        self._commit_ready()
        sampled = result.by_request()
        touched = []
        for s in plan.seqs:
            req = self._by_id.get(s.req_id)
            if req is None:
                continue   # finished or aborted meanwhile
            if s.sample:
                req.num_pending_samples -= 1
            error = result.failed.get(s.req_id)
            if error is not None:
                req.error = error
                req.finish(FinishReason.ERROR)
            elif s.req_id in sampled:   # a request preempted since still keeps its tokens
                tokens = [t for t, _ in sampled[s.req_id]]
                if s.num_drafts:
                    self._settle_drafts(req, s, len(tokens), result.verified_drafts.get(s.req_id, s.num_drafts))
                for t in tokens:
                    req.append_token(t)
                    if req.is_finished:   # a stop token or the length inside an accepted run
                        break
                if req.status is RequestStatus.RUNNING:   # drafts follow the last token; a preempted one redoes it
                    req.drafts = result.drafts.get(s.req_id, [])
            else:
                continue
            if req.is_finished:
                self.finish(req)
            touched.append(req)
        return touched

    def _settle_drafts(self, req: Request, s: SeqStep, emitted: int, verified: int) -> None:
        """A speculative step computed [start, start + 1 + drafts) but only its first `emitted` tokens
        (the last real token and the accepted drafts) are the sequence's: the rest is rolled back.
        `verified`: the drafts the runner verified (its grammar may have cut the others; those count
        as drafted nowhere, as a drafter's cut drafts never reach the scheduler)."""
        if verified:
            self.spec_stats.record(verified, emitted - 1)
        req.num_draft_tokens += verified
        req.num_accepted_tokens += emitted - 1
        if emitted > 1:
            req.draft_misses, req.draft_pause = 0, 0
        else:
            req.draft_misses += 1
            if req.draft_misses >= self.misses_before_pause:
                req.draft_pause = min(LONGEST_PAUSE, 2 * req.draft_pause or FIRST_PAUSE)
                req.drafts_resume_at, req.draft_misses = self._step + req.draft_pause, 0
        end = s.start + emitted
        if req.status is RequestStatus.RUNNING and req.num_computed_tokens == s.start + s.num_new_tokens:
            req.num_computed_tokens = end
        self._uncommitted = [(r, end if r is req and e == s.start + s.num_new_tokens else e)
                             for r, e in self._uncommitted]

    def _commit_ready(self) -> None:
        """Commit the KV of scheduled steps whose tokens are all known on the host (a decode step's
        input sampled by the step before is known once that step's output is in)."""
        waiting = []
        for req, end in self._uncommitted:
            if self._by_id.get(req.request_id) is not req or req.status is not RequestStatus.RUNNING:
                continue   # finished or preempted: its pages are gone
            if end > len(req.all_token_ids):
                waiting.append((req, end))
            else:
                self.kv.commit(req.request_id, req.cache_token_ids, end)
        self._uncommitted = waiting

    @staticmethod
    def _finishing(req: Request) -> bool:
        """A sample in flight will reach the request's length limit: another step would be wasted."""
        return req.num_pending_samples > 0 and (
            len(req.output_token_ids) + req.num_pending_samples >= req.params.max_tokens
            or req.num_tokens >= req.max_total_tokens)

    def _admit(self, out: _Decision, budget: int) -> None:
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_tokens - 1]
        owed = sum(self._prefill_growth(r) for r in prefilling)
        # One step's worth of transient pages on top (a chunk's sliding blocks before its commit
        # drops them): the token budget bounds what all of a step's chunks hold together.
        transient = max((self._step_transient(r) for r in prefilling), default=0)
        adapters = self._active_adapters()
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            if self.lora_slots is not None and not self.lora_slots.fits(req.lora, adapters):
                continue  # --max-loras adapters run already: it waits for one of them to drain
            sibling = req.wait_for
            if sibling is not None and not sibling.is_finished and not sibling.prompt_computed:
                continue  # its first sibling has not cached the shared prompt yet
            if req.grammar is not None and not req.grammar.done():
                continue  # its grammar is compiling on a worker thread: the others go first
            if req.num_pending_samples:
                return    # preempted with a sample in flight: its tokens are not all known yet
            # Checked before the prefix lookup (which hashes the prompt): a blocked head of the queue
            # costs no hashing per step.
            transient = max(transient, self._step_transient(req))
            if self.running and self.kv.num_free_pages < owed + transient + self.kv.pages_at(req.num_tokens):
                return  # its prompt would later take pages an admitted prompt needs (or lack its own)
            tokens = req.cache_token_ids
            hit = self.kv.lookup(req.request_id, tokens, req.block_hashes)
            n = self._chunk(req, hit, req.num_tokens - hit, budget)
            if n == 0:
                return  # its next image or clip does not fit this step's budget: it waits (first come, first served)
            if not self.kv.allocate(req.request_id, tokens, hit, hit + n, prefill=True, chain=req.block_hashes):
                return  # first come, first served: nobody overtakes a request that does not fit
            owed += self._prefill_growth(req, hit + n)
            self.waiting.remove(req)
            req.num_computed_tokens = hit
            if req.num_preemptions == 0:   # a resumed request's hits are its own recomputed blocks
                req.num_cached_tokens = hit
                self.kv.record_prefix_query(len(tokens) - 1, hit)
            req.status = RequestStatus.RUNNING
            if req.lora is not None:
                adapters.add(req.lora.key)
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
    def _chunk(req: Request, start: int, pending: int, budget: int) -> int:
        """Tokens to run for `req` from `start` this step: within the budget, within its own chunk
        limit (a request that fits the KV cache only when prefilled in smaller chunks), and never
        ending inside an image or clip (an image's tokens see each other: the chunk stops before the image, or
        is 0 when the image starts it and does not fit)."""
        n = min(pending, budget)
        if req.max_chunk_tokens is not None:
            n = min(n, req.max_chunk_tokens)
        for im in req.media:
            if im.start < start + n < im.end:
                n = max(0, im.start - start)
        return n

    def _allocate_or_preempt(self, req: Request, n: int, out: _Decision, prefill: bool) -> bool:
        """Pages for `n` more tokens of `req`, preempting the most recently admitted requests as
        needed. False if `req` itself had to be preempted. `prefill`: the step may use scratch (never
        for drafts: a rejected draft's block is read again)."""
        start = req.num_computed_tokens
        while not self.kv.allocate(req.request_id, req.cache_token_ids, start, start + n, prefill=prefill):
            victim = max(self.running, key=lambda r: r.admitted_order)
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: _Decision) -> None:
        self.running.remove(req)
        out.seqs = [s for s in out.seqs if s.request is not req]   # it may have been scheduled already
        self.kv.free(req.request_id)
        self._uncommitted = [(r, end) for r, end in self._uncommitted if r is not req]
        if req.sent_tables is not None:
            self._released.append(req.request_id)
            req.sent_tables = None
        req.num_computed_tokens = 0
        req.drafts = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and free its pages."""
        if self._by_id.pop(req.request_id, None) is None:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        if req.sampling_sent or req.sent_tables is not None:
            self._finished.append(req.request_id)
            req.sent_tables = None
