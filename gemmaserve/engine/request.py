"""A request's life: its tokens, progress, and the output users see."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # not admitted yet, or preempted (holds no KV pages)
    RUNNING = "running"      # holds KV pages; prefilling or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"            # an end-of-sequence token
    LENGTH = "length"        # max_tokens, or the model's length limit
    ABORT = "abort"


@dataclass
class Request:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    max_total_tokens: int                  # prompt + output may not exceed this (max_model_len)
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0           # tokens whose K/V sit in the cache
    num_cached_tokens: int = 0             # of those, tokens served by the prefix cache (all admissions)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        if token in self.stop_token_ids and not self.params.ignore_eos:
            self.finish(FinishReason.STOP)
        elif len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= self.max_total_tokens:
            self.finish(FinishReason.LENGTH)

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool

    def to_dict(self) -> dict:
        first = self.outputs[0]
        return {"request_id": self.request_id, "prompt": self.prompt, "text": first.text,
                "token_ids": first.token_ids, "finish_reason": first.finish_reason,
                "prompt_tokens": len(self.prompt_token_ids), "completion_tokens": len(first.token_ids)}
