"""From committed token ids to what users read: text, stop strings, logprobs, per-step outputs.

The scheduler commits token ids and ends a request on what needs no text (a stop token id, end of
sequence, length). Everything made of text lives here, one `OutputState` per engine request:

    Scheduler.update_from_output -> requests with new token ids
    OutputProcessor.process(req, logprobs) -> CompletionOutput, and the stop string that matched (if any)

A stop string ends a completion here; the engine then finishes the request in the scheduler. Tokens
committed after the one that completed a stop string (a speculative step commits several at once) are
never reported, so the output ends exactly where one token per step would have ended it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer, StopStringFilter
from .request import CompletionOutput, FinishReason, Request, RequestOutput, TokenLogprob

log = logging.getLogger(__name__)


@dataclass
class OutputState:
    """What one engine request has shown, and will show, its user."""

    detokenizer: IncrementalDetokenizer
    stop_filter: StopStringFilter
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)   # reported (a stop string cuts what follows)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    seen: int = 0                                        # the request's output tokens looked at
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    _emitted_tokens: int = 0
    _emitted_chars: int = 0
    _emitted_logprobs: int = 0

    def feed(self, req: Request, logprobs: list[TokenLogprob | None]) -> None:
        """Take the request's new tokens (and the logprobs the step sampled for them, in order)."""
        new = req.output_token_ids[self.seen:]
        self.seen += len(new)
        # Ended by a token id: that last token is reported but shows no text.
        by_token = req.is_finished and req.finish_reason is FinishReason.STOP
        for i, token in enumerate(new):
            self.token_ids.append(token)
            if i < len(logprobs) and logprobs[i] is not None:
                self.logprobs.append(logprobs[i])
            if by_token and i == len(new) - 1:
                break
            self.text += self.stop_filter.feed(self.detokenizer.step([token]))
            if self.stop_filter.matched is not None:
                self.finish_reason, self.stop_reason = FinishReason.STOP, self.stop_filter.matched
                return
        if req.is_finished and req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.text += self.stop_filter.feed(self.detokenizer.finish())
            if self.stop_filter.matched is not None:   # the held-back text completed a stop string
                self.finish_reason, self.stop_reason = FinishReason.STOP, self.stop_filter.matched
            else:
                self.text += self.stop_filter.flush()
                self.finish_reason, self.stop_reason = req.finish_reason, req.stop_reason

    def take(self, req: Request) -> CompletionOutput:
        """What is new since the last output (`delta_*`); the whole text, tokens and logprobs only
        once it finishes (copying them into every streamed output would cost O(n) per token)."""
        delta_ids = self.token_ids[self._emitted_tokens:]
        delta_text = self.text[self._emitted_chars:]
        delta_lp = self.logprobs[self._emitted_logprobs:]
        self._emitted_tokens = len(self.token_ids)
        self._emitted_chars = len(self.text)
        self._emitted_logprobs = len(self.logprobs)
        done = self.finish_reason is not None
        return CompletionOutput(
            index=req.index, text=self.text if done else "", token_ids=list(self.token_ids) if done else [],
            finish_reason=self.finish_reason.value if done else None, stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if done and self.want_logprobs else None,
            delta_text=delta_text, delta_token_ids=delta_ids,
            delta_logprobs=delta_lp if self.want_logprobs else None, error=req.error,
            num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens)


@dataclass(frozen=True)
class Ending:
    """How the text ended a request (the engine finishes it)."""

    reason: FinishReason
    stop_reason: str | None
    error: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, OutputState] = {}

    def add(self, req: Request) -> None:
        self._states[req.request_id] = OutputState(
            IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens),
            StopStringFilter(tuple(req.params.stop)), req.params.logprobs is not None)

    def state(self, request_id: str) -> OutputState:
        return self._states[request_id]

    def process(self, req: Request, logprobs: list[TokenLogprob | None] = ()) -> "Ending | None":
        """Read `req`'s newly committed tokens. Returns how the text ended the request, if it did: a stop
        string, or a detokenizer failure (this request fails alone). The caller, which owns the request's
        state, finishes it."""
        state = self._states[req.request_id]
        if state.finish_reason is not None:
            return None
        try:
            state.feed(req, list(logprobs))
        except Exception as exc:   # e.g. detokenizing: this request fails, the batch goes on
            log.error("request %s failed", req.request_id, exc_info=exc)
            state.finish_reason = FinishReason.ERROR
            return Ending(FinishReason.ERROR, None, f"{type(exc).__name__}: {exc}")
        if state.finish_reason is FinishReason.STOP and isinstance(state.stop_reason, str) and not req.is_finished:
            return Ending(FinishReason.STOP, state.stop_reason)
        return None

    def output(self, req: Request) -> RequestOutput:
        """The request's output for this step (the state goes once the final one is taken)."""
        state = self._states[req.request_id]
        if req.is_finished and state.finish_reason is None:   # aborted or failed: no more tokens come
            state.finish_reason, state.stop_reason = req.finish_reason, req.stop_reason
        completion = state.take(req)
        if completion.finished:
            del self._states[req.request_id]
        return RequestOutput(req.group_id, req.prompt, req.prompt_token_ids, [completion], completion.finished,
                             req.num_cached_tokens)

    def __len__(self) -> int:
        return len(self._states)
