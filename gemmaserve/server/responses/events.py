"""What a completion's text says, as events in order: reasoning, answer text, tool calls. The Responses output
(streamed or not) is built from these events alone.

`OutputEvents` is the stand-in for the incremental output parser (server/output_parser.py, whose events have
these kinds): the thinking and the answer are split as the text arrives (`ReasoningStream`); with tools offered
the answer is held until the completion ends and read as the chat route reads it (`ChatJob.read`), since only then
is it known whether it is a call.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..reasoning import ReasoningStream
from ..serving_chat import ChatJob


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCallDone:
    index: int


OutputEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallDelta | ToolCallDone


class OutputEvents:
    """One completion's text deltas -> its events; `finish` with the whole text gives the rest and the finish
    reason as the chat route reports it ("tool_calls" when it called)."""

    def __init__(self, job: ChatJob):
        self.job = job
        fmt = job.answer.reasoning
        self.stream = ReasoningStream(fmt) if fmt is not None else None

    def feed(self, delta: str) -> list[OutputEvent]:
        if self.stream is None:
            return self._answer(delta)
        thought, answer = self.stream.feed(delta)
        return ([ReasoningDelta(thought)] if thought else []) + self._answer(answer)

    def finish(self, text: str, finish_reason: str | None) -> tuple[list[OutputEvent], str | None]:
        events: list[OutputEvent] = []
        if self.stream is not None:
            thought, answer = self.stream.finish()
            events = ([ReasoningDelta(thought)] if thought else []) + self._answer(answer)
        if self.job.calling is None:
            return events, finish_reason
        read = self.job.read(text, finish_reason)
        if read.content:
            events.append(ContentDelta(read.content))
        for k, call in enumerate(read.tool_calls):
            events += [ToolCallStart(k, call["id"], call["function"]["name"]),
                       ToolCallDelta(k, call["function"]["arguments"]), ToolCallDone(k)]
        return events, read.finish_reason

    def _answer(self, text: str) -> list[OutputEvent]:
        if self.job.calling is not None or not text:
            return []   # held: read whole at the end
        text = self.job.answer.clean(text)
        return [ContentDelta(text)] if text else []
