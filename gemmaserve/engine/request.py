"""A request's life in the engine: its tokens and progress (its text: output_processor.py), and the
outputs users see.

One user request with `n` completions is `n` engine requests (a *group*): they share the group id,
the prompt and, through the prefix cache, the prompt's KV pages; each has its own index, tokens,
random generator and text.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..kv.block_hash import HashChain, chain_root
from .media.items import MediaItem, hash_token_ids
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .lora import LoRARef


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # not admitted yet, or preempted (holds no KV pages)
    RUNNING = "running"      # holds KV pages; prefilling or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"            # an end-of-sequence / stop token, or a stop string
    LENGTH = "length"        # max_tokens, or the model's length limit
    ABORT = "abort"
    ERROR = "error"          # an internal failure while running this request (a bug; see the log)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float                      # under the model's raw distribution (before sampling filters)
    top: tuple[tuple[int, float], ...]  # the most likely alternatives, best first


@dataclass(eq=False)   # identity: requests are compared in scheduler lists, never by value
class Request:
    """Who writes what: `LLMEngine.add_request` the fields up to `media` (then never again); the KV
    manager `block_hashes`; the scheduler everything about progress and tokens (output ids, computed and
    pending counts, status, admission and table bookkeeping, the cached and draft counters) and the ends
    that need no text (stop token, end of sequence, length, a failed step). The engine alone ends a
    request otherwise (abort; a stop string or a text failure the output processor reports) and hands
    it to the scheduler to free. Text, stop strings and logprobs are not here: output_processor.py."""

    request_id: str                        # unique engine id ("<group id>" or "<group id>#<index>")
    group_id: str                          # the id the user sees
    index: int                             # which of the group's n completions
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]          # the tokenizer's end-of-sequence tokens
    max_total_tokens: int                  # prompt + output may not exceed this (max_model_len)
    seed: int = 0                          # of its random generator (the runner holds the generator)
    wait_for: "Request | None" = None      # admit only once this request's prompt is in the KV cache
    grammar: Future[Any] | None = None     # structured output: admit only once its grammar is compiled
    max_chunk_tokens: int | None = None    # prefill at most this many tokens a step (it fits only so)
    block_hashes: list[bytes] = field(default_factory=list)   # prefix-cache chain, grown by the KV manager
    media: list[MediaItem] = field(default_factory=list)      # images and clips, in prompt order
    lora: LoRARef | None = None            # its LoRA adapter (None: the base model)
    output_token_ids: list[int] = field(default_factory=list)   # committed (a stop string may end the output earlier)
    num_computed_tokens: int = 0           # tokens whose K/V sit in the cache or are being computed
    num_pending_samples: int = 0           # sampled by a step in flight, not appended yet
    num_cached_tokens: int = 0             # prompt tokens the prefix cache served at its first admission
    num_draft_tokens: int = 0              # speculative decoding: tokens drafted for it ...
    num_accepted_tokens: int = 0           # ... and how many of them the target agreed with
    drafts: list[int] = field(default_factory=list)   # guesses the runner's drafter made after its last step
    draft_misses: int = 0                  # speculative steps in a row whose drafts were all rejected ...
    draft_pause: int = 0                   # ... the last pause they caused (steps), and until which step
    drafts_resume_at: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None   # the stop token id (or, set by the engine, stop string) that ended it
    error: str | None = None               # what failed, when finish_reason is ERROR
    num_preemptions: int = 0
    admitted_order: int = -1               # when it was (last) admitted: preemption picks the latest
    last_served: int = -1                  # last step that ran it: fairness when the budget runs out
    sent_tables: list[tuple[int, int]] | None = None   # per group: (first, end) block the runner holds
    sampling_sent: bool = False            # the runner holds its sampling state
    _all: list[int] = field(init=False)     # prompt + output, grown in place (no copy per step)
    _keyed: list[int] | None = field(init=False)   # what the prefix cache hashes, with media (else _all)

    def __post_init__(self) -> None:
        if self.lora is not None and not self.block_hashes:   # KV under an adapter is keyed apart
            self.block_hashes = HashChain(chain_root(self.lora.salt))
        self._all = list(self.prompt_token_ids)
        self._keyed = hash_token_ids(self._all, self.media) if self.media else None

    @property
    def cache_token_ids(self) -> list[int]:
        """The ids the prefix cache keys blocks by: `all_token_ids`, with each image's or clip's tokens standing
        for its content (a live list: do not modify)."""
        return self._all if self._keyed is None else self._keyed

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output tokens (a live list: do not modify)."""
        return self._all

    @property
    def num_tokens(self) -> int:
        """Tokens known, plus those sampled by a step in flight (asynchronous scheduling)."""
        return len(self._all) + self.num_pending_samples

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def prompt_computed(self) -> bool:
        return self.num_computed_tokens >= len(self.prompt_token_ids)

    def append_token(self, token: int) -> None:
        """Commit a sampled token; finish on a stop token, end of sequence or length (stop strings are
        text, which the output processor reads)."""
        self.output_token_ids.append(token)
        self._all.append(token)
        if self._keyed is not None:
            self._keyed.append(token)
        if token in self.params.stop_token_ids:
            self.finish(FinishReason.STOP, token)
        elif token in self.eos_token_ids and not self.params.ignore_eos:
            self.finish(FinishReason.STOP, None)
        elif len(self.output_token_ids) >= self.params.max_tokens or len(self._all) >= self.max_total_tokens:
            self.finish(FinishReason.LENGTH, None)

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


@dataclass
class CompletionOutput:
    index: int
    text: str                              # the whole text: on the final output only ("" before)
    token_ids: list[int]                   # likewise
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""                   # streaming: what is new since this completion's last output
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None
    error: str | None = None               # finish_reason "error": what failed
    num_draft_tokens: int = 0              # speculative decoding so far: drafted, and accepted by the target
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0          # prompt tokens served by the prefix cache
    prompt_index: int | None = None     # set by LLM.stream(): which of the call's prompts it answers

    def to_dict(self) -> dict:
        """JSON-ready summary (the CLI's --json line)."""
        def completion(c: CompletionOutput) -> dict:
            d = {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
            if c.stop_reason is not None:
                d["stop_reason"] = c.stop_reason
            if c.logprobs is not None:
                d["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                                  "top": [[t, p] for t, p in lp.top]} for lp in c.logprobs]
            return d

        first = self.outputs[0]
        out = {"request_id": self.request_id, "prompt": self.prompt, "text": first.text,
               "token_ids": first.token_ids, "finish_reason": first.finish_reason,
               "prompt_tokens": len(self.prompt_token_ids),
               "completion_tokens": sum(len(c.token_ids) for c in self.outputs)}
        drafted = sum(c.num_draft_tokens for c in self.outputs)
        if drafted:
            accepted = sum(c.num_accepted_tokens for c in self.outputs)
            out["speculative"] = {"draft_tokens": drafted, "accepted_tokens": accepted,
                                  "acceptance_rate": round(accepted / drafted, 4)}
        if len(self.outputs) > 1 or first.stop_reason is not None or first.logprobs is not None:
            out["completions"] = [completion(c) for c in self.outputs]
        return out
