"""Whether a request can ever run, checked once before it reaches the scheduler: sampling values, grammar,
context length, vocabulary, media sizes and the KV budget.

`RequestValidator.check` is the one implementation: `LLMEngine.validate` runs it (the server, before a
stream starts; `LLM`, before anything is queued) and hands back a `CheckedRequest`, which `add_checked`
queues without checking again; `add_request` runs it itself for raw input. A request that passes cannot
fail for its shape later. Every failure is a `UserInputError`; the two kinds a caller answers differently
are subclasses: `ContextLengthError` (OpenAI's `context_length_exceeded`) and `GrammarError` (the
response format or tools, not the prompt, are wrong).

Everything read here is fixed when the engine is built (lengths, vocabulary, KV geometry) or thread-safe
(the grammar cache), so a check may run on any thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..errors import UserInputError
from ..kv.base import KVCacheManager
from ..models.multimodal import MediaLayout, Modality
from ..units import format_bytes
from .media.items import MediaItem
from .sampling_params import SamplingParams
from .structured.structured_output import Grammars

log = logging.getLogger(__name__)


class ContextLengthError(UserInputError):
    """The prompt (with `strict_length`: and max_tokens) does not fit max_model_len."""

    def __init__(self, message: str, prompt_tokens: int, max_tokens: int, limit: int):
        super().__init__(message)
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit


class GrammarError(UserInputError):
    """The request's structured output spec (response format, tools) does not compile."""


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed the checks: `LLMEngine.add_checked` queues it as it is."""

    prompt_ids: list[int]
    params: SamplingParams
    media: list[MediaItem] = field(default_factory=list)
    lora: str | None = None                 # a loaded adapter's name (None: the base model)
    text: str = ""                          # the prompt as text (outputs carry it)
    max_chunk_tokens: int | None = None     # most prompt tokens per prefill step when the KV fits only in chunks


@dataclass(frozen=True)
class RequestValidator:
    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int
    kv: KVCacheManager                      # its geometry only: pages a sequence needs, pool size
    grammars: Grammars
    layouts: dict[Modality, MediaLayout] = field(default_factory=dict)   # what the model reads besides text

    def check(self, prompt_ids: list[int], params: SamplingParams, media: list[MediaItem] | None = None,
              wait_for_grammar: bool = True, strict_length: bool = False) -> int | None:
        """Raise UserInputError if the request can never run (too long, larger than the KV budget, or
        naming tokens the model does not have). Returns the most prompt tokens it may prefill in one
        step when it fits only in chunks smaller than `max_num_batched_tokens`, else None.

        A structured request's grammar is compiled (on a worker thread, cached) and, with
        `wait_for_grammar`, waited for, so that a bad spec fails here; without, only a compile that
        has already failed does (the engine thread never waits: a later failure fails the request).
        `strict_length`: the prompt and max_tokens must fit max_model_len together (OpenAI's rule, the
        server's); without, generation stops at max_model_len (finish reason "length")."""
        params.validate()
        if params.structured_output is not None:
            try:
                grammar = self.grammars.submit(params.structured_output)
                if wait_for_grammar or grammar.done():
                    grammar.result()
            except UserInputError as exc:
                raise GrammarError(str(exc)) from None
        n, limit = len(prompt_ids), self.max_model_len
        if strict_length and n + params.max_tokens > limit:
            raise ContextLengthError(f"prompt is {n} tokens long and max_tokens is {params.max_tokens}; max_model_len "
                                     f"is {limit}", n, params.max_tokens, limit)
        if n >= limit:
            raise ContextLengthError(f"prompt is {n} tokens long; max_model_len is {limit}, which must leave room "
                                     "for at least one generated token", n, params.max_tokens, limit)
        vocab = self.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise UserInputError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab})")
        given = {it.modality for it in media or ()}
        soft = {self.layouts[m].token_id for m in given}
        if prompt_ids and (min(prompt_ids) < 0 or max((t for t in prompt_ids if t not in soft), default=0) >= vocab):
            raise UserInputError(f"prompt token ids must be in [0, {vocab})")
        for modality, layout in self.layouts.items():
            if modality not in given and layout.token_id in prompt_ids:
                raise UserInputError(f"the prompt holds {modality.value} tokens but no {modality.inputs}")
        largest = max(media or (), key=lambda it: it.length, default=None)
        if largest is not None and largest.length > self.max_num_batched_tokens:
            raise UserInputError(f"an input ({largest.modality.value}) takes {largest.length} tokens, more than "
                                 f"max_num_batched_tokens ({self.max_num_batched_tokens}): it is never split across "
                                 "prefill chunks")
        return self._fit(min(n + params.max_tokens, limit), media)

    def _fit(self, peak: int, media: list[MediaItem] | None) -> int | None:
        """The prefill chunk a sequence of `peak` tokens fits the KV pool with (None: the full budget)."""
        chunk = self.max_num_batched_tokens
        fitting = self.kv.max_chunk(peak, chunk)
        if fitting == chunk:
            return None
        if media and fitting < max(it.length for it in media):
            fitting = 0   # an image or clip is never split across chunks: it must fit one
        if fitting:
            log.info("a request of %d tokens fits the KV cache only in prefill chunks of %d tokens", peak, fitting)
            return fitting
        need = self.kv.peak_pages(peak, 1)
        why = " (its pinned pool split leaves one side too small)" if need <= self.kv.num_pages else ""
        raise UserInputError(f"request needs {format_bytes(need * self.kv.page_bytes)} of KV cache for {peak} tokens, "
                             f"but the KV cache has {format_bytes(self.kv.num_pages * self.kv.page_bytes)}{why}; "
                             "raise --kv-cache-memory or lower max_tokens")
