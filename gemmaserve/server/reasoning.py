"""A thinking model's reasoning, apart from its answer (OpenAI-compatible servers' `reasoning_content`).

    Gemma 4:  <|channel>thought\\n ... reasoning ... <channel|> answer
              (thinking is asked for with chat_template_kwargs {"enable_thinking": true}; a tool call,
              <|tool_call>, also ends the reasoning)

The format comes from the tokenizer: a checkpoint whose tokenizer has both channel tokens as special tokens has
it. Outputs are read with special tokens kept (the markers are special tokens); what is left of them in an
answer is removed unless the request asked for special tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..engine.structured.structured_output import TOOL_CALL_BEGIN

BEGIN, END, LABEL = "<|channel>", "<channel|>", "thought"


@dataclass(frozen=True)
class ReasoningFormat:
    begin_id: int
    end_id: int
    hidden: re.Pattern | None = None   # the special token texts (an answer shows none unless asked to)
    specials: tuple[str, ...] = ()      # the same texts, sorted (a stream holds what may begin one)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ReasoningFormat | None":
        ids = {tokenizer.special_text(i): i for i in tokenizer.special_ids}
        if BEGIN not in ids or END not in ids:
            return None
        texts = sorted((t for t in ids if t), key=len, reverse=True)
        return cls(ids[BEGIN], ids[END], re.compile("|".join(map(re.escape, texts))), tuple(sorted(texts)))

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a whole output."""
        stream = ReasoningStream(self)
        reasoning, answer = stream.feed(text)
        more_r, more_a = stream.finish()
        reasoning += more_r
        answer += more_a
        return (reasoning if stream.thought else None), answer

    def reasoning_tokens(self, token_ids: list[int], opened: bool = False) -> int:
        """Output tokens spent in thought channels, their markers included: every channel the output opens
        (after a tool call the model thinks again), and from the first token when the prompt opened one."""
        count, inside = 0, opened
        for t in token_ids:
            inside = inside or t == self.begin_id
            count += inside
            inside = inside and t != self.end_id
        return count

    def clean(self, answer: str) -> str:
        return answer if self.hidden is None else self.hidden.sub("", answer)


@dataclass
class ReasoningStream:
    """Splits an output given in pieces (stream deltas) into reasoning and answer text, whatever the cut points:
    a marker split across pieces waits in `pending` until it can be told apart."""

    fmt: ReasoningFormat
    state: str = "first"       # first -> reasoning -> answer, or first -> answer
    thought: bool = False
    pending: str = ""
    labelled: bool = False

    def feed(self, piece: str) -> tuple[str, str]:
        self.pending += piece
        reasoning = answer = ""
        while True:
            if self.state == "first":
                text = self.pending.lstrip("\n ")
                if text.startswith(BEGIN):
                    self.state, self.thought, self.pending = "reasoning", True, text[len(BEGIN):]
                    continue
                if BEGIN.startswith(text) and text:
                    return reasoning, answer   # may still be the marker
                if not text and not self.pending.strip("\n "):
                    return reasoning, answer
                self.state = "answer"
                continue
            if self.state == "reasoning":
                if not self.labelled:   # the channel's name ("thought\n") is not reasoning
                    heads = (LABEL + "\n", LABEL + END)
                    if any(len(self.pending) < len(h) and h.startswith(self.pending) for h in heads):
                        return reasoning, answer   # it may still be arriving
                    if self.pending.startswith(LABEL) and self.pending[len(LABEL):].startswith(("\n", END)):
                        self.pending = self.pending[len(LABEL):].removeprefix("\n")
                    self.labelled = True
                ends = [(i, m) for m in (END, TOOL_CALL_BEGIN) if (i := self.pending.find(m)) >= 0]
                if ends:
                    i, marker = min(ends)
                    reasoning += self.pending[:i]
                    # the end marker is dropped; a tool call is the answer's start
                    self.pending = self.pending[i + len(END):] if marker == END else self.pending[i:]
                    self.state = "answer"
                    continue
                keep = _partial_suffix(self.pending, (END, TOOL_CALL_BEGIN))
                reasoning += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return reasoning, answer
            answer += self.pending
            self.pending = ""
            return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is still held when the output ends."""
        rest, self.pending = self.pending, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:n]):
                best = max(best, n)
                break
    return best
