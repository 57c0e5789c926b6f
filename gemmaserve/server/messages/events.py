"""A chat generation read as parser events: reasoning deltas, content deltas, tool calls (start, arguments,
done). The Messages stream (stream.py) is written against these kinds only.

`ChatEvents` builds them from what exists now: `ReasoningStream` splits thinking from the answer as it arrives;
with tools offered the answer is held until the end, where `ChatJob.read` parses the calls (whether text is a call
is known only then). The incremental output parser (server/output_parser.py, planned) emits the same kinds
while generating; swapping it in replaces this class."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..reasoning import ReasoningStream
from ..serving_chat import ChatAnswer, ChatJob


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str   # a piece of the arguments' JSON text


@dataclass(frozen=True)
class ToolCallDone:
    index: int


ParserEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallDelta | ToolCallDone


@dataclass
class ChatEvents:
    """One completion's output pieces -> events; `finish` also gives the whole answer as `ChatJob.read` reads it
    (stop reason and calls, for the closing message)."""

    job: ChatJob
    _thinking: ReasoningStream | None = field(init=False)

    def __post_init__(self) -> None:
        fmt = self.job.answer.reasoning
        self._thinking = ReasoningStream(fmt) if fmt is not None else None

    def feed(self, piece: str) -> list[ParserEvent]:
        if self._thinking is None:
            thought, text = "", piece
        else:
            thought, text = self._thinking.feed(piece)
        return self._events(thought, text)

    def finish(self, text: str, finish_reason: str | None) -> tuple[list[ParserEvent], ChatAnswer]:
        """The held rest, then (tools offered) the answer's content and calls; `text`: the whole output."""
        thought, rest = self._thinking.finish() if self._thinking is not None else ("", "")
        events = self._events(thought, rest)
        answer = self.job.read(text, finish_reason)
        if self.job.calling is not None:
            if answer.content:
                events.append(ContentDelta(answer.content))
            for k, call in enumerate(answer.tool_calls):
                fn = call["function"]
                events += [ToolCallStart(k, call["id"], fn["name"]), ToolCallDelta(k, fn["arguments"]),
                           ToolCallDone(k)]
        return events, answer

    def _events(self, thought: str, text: str) -> list[ParserEvent]:
        out: list[ParserEvent] = [ReasoningDelta(thought)] if thought else []
        text = self.job.answer.clean(text) if self._thinking is not None else text
        if text and self.job.calling is None:   # with tools: held for `finish`
            out.append(ContentDelta(text))
        return out


def tool_input(arguments: str) -> dict:
    """A call's arguments (OpenAI's JSON text) as Anthropic's `input` object."""
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {}
