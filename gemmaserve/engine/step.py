"""One engine step as plain data: what the scheduler decided (`StepPlan`) and what the runner sampled
(`StepResult`). Only these cross from the scheduler to the runner and back, so the runner never reads
a live `Request`, and a plan can be sent to another process (a tensor-parallel rank) as JSON.

    Scheduler.schedule() -> StepPlan --> ModelRunner.execute(plan) -> StepResult
                                          (block tables updated by the plan's deltas)
    Scheduler.update_from_output(plan, result)   commits KV, appends tokens, finishes requests

Block tables travel as deltas. Per sequence and layer group the runner holds the slot rows of the
live blocks from logical block `first` on; a step moves `first` forward (a sliding window dropped
blocks) and appends new rows. A slot's pages (one per layer of the group) travel once, when the
slot is created (`SlotUpdate`).

    runner's table, sliding group:   first=3  [s3 s4 s5]
    delta (first=4, added=[s6])  ->  first=4  [s4 s5 s6]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..kv.connector import KVTransfers
from .media.items import MediaItem
from .request import TokenLogprob
from .sampling_params import SamplingParams

# A token the runner sampled in the step before, not yet known to the host (asynchronous scheduling).
DEVICE_TOKEN = -1
# A draft slot: the runner's drafter puts its guess there before the target's forward (draft_model.py).
DRAFT_TOKEN = -2


@dataclass
class TableDelta:
    """One sequence's block table in one group, after this step's allocation."""

    first: int                                       # logical block index of the first live block
    added: list[int] = field(default_factory=list)   # slot rows appended at the end


@dataclass
class NewRequest:
    """What the runner keeps for a request from its first step until it finishes: how to sample."""

    req_id: str
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]      # repetition penalty reads them
    media: list[MediaItem] = field(default_factory=list)   # the runner encodes each once, when a chunk first covers it
    # Tokens sampled before this runner met the request (another engine's, under disaggregated serving):
    # its grammar and penalty counts start after them.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class SeqStep:
    req_id: str
    start: int                   # tokens already in the KV cache: positions start, start + 1, ...
    token_ids: list[int]         # the tokens to compute (DEVICE_TOKEN: last step's sample, on the device)
    sample: bool                 # this step brings the request up to date: sample its next token
    deltas: list[TableDelta] | None = None   # per group; None: no table changed
    new_table: bool = False      # the runner holds no table for it (deltas carry the whole table)
    # Speculative decoding: the last `num_drafts` of token_ids are guesses the runner checks against the
    # target's own choices at each position (sampling every one), emitting 1..num_drafts + 1 tokens
    # (DRAFT_TOKEN: a slot the runner's drafter fills).
    num_drafts: int = 0
    # Drafts the runner's drafter should make after this step for the token it emits last (MTP).
    propose: int = 0
    lora_slot: int = -1          # the device slot of its LoRA adapter (-1: the base model)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class LoRALoad:
    """Put this adapter (registered with these weights) into this device slot before the step runs."""

    slot: int
    name: str
    path: str
    digest: str


@dataclass
class SlotUpdate:
    group: int
    rows: list[int]
    pages: list[list[int]]       # per row: the page of each layer of the group


@dataclass
class StepPlan:
    step: int
    seqs: list[SeqStep] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    slot_updates: list[SlotUpdate] = field(default_factory=list)
    released: list[str] = field(default_factory=list)   # preempted since the last plan: tables gone
    finished: list[str] = field(default_factory=list)   # finished or aborted: tables and sampling state gone
    lora_loads: list[LoRALoad] = field(default_factory=list)   # adapters to copy into slots first
    # Copies between the device cache and an outside store (a host tier), before the forward, in order.
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    def subset(self, index: int) -> "StepPlan":
        """The same step for one of its sequences (table and request changes are the runner's to apply
        once; see ModelRunner.execute)."""
        return dataclasses.replace(self, seqs=[self.seqs[index]])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepPlan":
        seqs = [SeqStep(**{**s, "deltas": None if s["deltas"] is None else [TableDelta(**t) for t in s["deltas"]]})
                for s in d["seqs"]]
        news = [NewRequest(**{**n, "params": SamplingParams(**n["params"]),
                              "media": [MediaItem(**i) for i in n.get("media", [])]}) for n in d["new_requests"]]
        return cls(d["step"], seqs, news, [SlotUpdate(**u) for u in d["slot_updates"]], list(d["released"]),
                   list(d["finished"]), [LoRALoad(**x) for x in d.get("lora_loads", [])],
                   KVTransfers.from_dict(d.get("kv_transfers")))


@dataclass
class StepResult:
    """The tokens each sequence of the plan with `sample` emitted, in plan order: one entry per token,
    so a speculative sequence has 1..num_drafts + 1 consecutive entries (`by_request` groups them)."""

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)   # req id -> what failed running it alone
    drafts: dict[str, list[int]] = field(default_factory=dict)   # req id -> its drafter's guesses (SeqStep.propose)
    # req id -> how many of the step's drafts it verified, where its grammar cut the others before the forward
    verified_drafts: dict[str, int] = field(default_factory=dict)

    def by_request(self) -> dict[str, list[tuple[int, TokenLogprob | None]]]:
        out: dict[str, list[tuple[int, TokenLogprob | None]]] = {}
        for req_id, token, logprob in zip(self.req_ids, self.token_ids, self.logprobs):
            out.setdefault(req_id, []).append((token, logprob))
        return out

    def merge(self, other: "StepResult") -> None:
        self.req_ids += other.req_ids
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.failed.update(other.failed)
        self.drafts.update(other.drafts)
        self.verified_drafts.update(other.verified_drafts)
