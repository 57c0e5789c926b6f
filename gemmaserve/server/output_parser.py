"""A model's output text -> reasoning, content and tool calls, incrementally: one `OutputParser` per request
choice, fed the text in whatever pieces the engine hands out (one token, several from a speculative step, a
marker cut anywhere), giving the same result as the whole text read at once.

Events (frozen dataclasses, the stable API that the chat, Responses and Messages routes build on):

    ReasoningDelta(text)               more of the thinking (Gemma 4's thought channel, its markers and
                                       "thought" label removed)
    ContentDelta(text)                 more of the answer
    ToolCallStart(index, id, name)     a call begins (0, 1, ... in order); sent as soon as its name is known
    ToolCallDelta(index, arguments)    a fragment of the call's arguments as JSON text (OpenAI's `arguments`)
    ToolCallDone(index, arguments)     the call is complete: the whole JSON text, equal to its fragments joined

A call cut short (max_tokens) or broken after its start has no ToolCallDone: it stays a call with the
arguments sent so far. `parse_output(text)` is `feed(text)` + `finish()` folded into a `ParsedOutput`, so a
streamed answer and a whole one agree by construction.

Formats read:
    thinking    <|channel>thought\\n ... <channel|>   anywhere in the output (after a tool result the model
                thinks again), or from the first character when the prompt opened the channel
                (`starts_in_reasoning`); a tool call (<|tool_call>) also ends it. Whitespace before the
                first channel is dropped.
    NATIVE      <|tool_call>call:NAME{key:<|"|>text<|"|>,n:1,xs:[...],o:{...}}<tool_call|>  (Gemma 4): the
                arguments are turned into JSON as they arrive; strings are copied (escaped) as they come.
                A name not among the tools, or text that is no call, stays content. Content is stripped
                and ends at <|tool_response>.
    JSON        {"name": NAME, "parameters" | "arguments": {...}}  as the whole answer (Gemma 3; a ```json
                fence allowed): held while it may still be a call, flowing as content once it cannot be.
"""

from __future__ import annotations

import bisect
import json
import random
import uuid
from dataclasses import dataclass
from typing import Union

from ..engine.structured.structured_output import (
    TOOL_CALL_BEGIN as CALL_BEGIN, TOOL_CALL_END as CALL_END, TOOL_RESPONSE as RESPONSE_BEGIN,
    TOOL_STRING as DELIM,
)
from .reasoning import BEGIN, END, LABEL, ReasoningFormat
from .tools import ToolCalling, ToolFormat

_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_CALL_HEAD = "call:"


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
    arguments: str


@dataclass(frozen=True)
class ToolCallDone:
    index: int
    arguments: str


Event = Union[ReasoningDelta, ContentDelta, ToolCallStart, ToolCallDelta, ToolCallDone]


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output read: reasoning (None when the model did not think), content (None when empty and
    tool-call syntax was read or calls were made), calls in OpenAI's shape."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict]


def fold(events: list[Event], thought: bool, content_optional: bool) -> ParsedOutput:
    """Events -> the output they describe (`thought`/`content_optional`: the parser's flags of the same name)."""
    reasoning, content, calls = [], [], {}
    for e in events:
        if isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls[e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, ToolCallDelta):
            calls[e.index]["function"]["arguments"] += e.arguments
    text = "".join(content)
    return ParsedOutput("".join(reasoning) if thought else None,
                        None if not text and (content_optional or calls) else text,
                        [calls[i] for i in sorted(calls)])


def parse_output(text: str, reasoning: ReasoningFormat | None = None, calling: ToolCalling | None = None,
                 starts_in_reasoning: bool = False, hide_specials: bool = False,
                 seed: str | None = None) -> ParsedOutput:
    parser = OutputParser(reasoning, calling, starts_in_reasoning, hide_specials, seed)
    events = parser.feed(text) + parser.finish()
    return fold(events, parser.thought, parser.content_optional)


class OutputParser:
    """One request choice's output, read incrementally (`feed` each new piece, `finish` at the end).

    reasoning            the thought channel's format, None to read none
    calling              the request's tools, None when none were offered
    starts_in_reasoning  the prompt opened the thought channel: the output starts inside it
    hide_specials        remove special-token texts left in the content (the format's `specials`)
    seed                 makes call ids reproducible (None: random)
    """

    def __init__(self, reasoning: ReasoningFormat | None = None, calling: ToolCalling | None = None,
                 starts_in_reasoning: bool = False, hide_specials: bool = False, seed: str | None = None):
        self.reasoning, self.calling = reasoning, calling
        self.native = calling is not None and calling.format is ToolFormat.NATIVE
        self.thought = bool(starts_in_reasoning and reasoning is not None)
        self.content_optional = self.native
        self._state = "reasoning" if self.thought else ("first" if reasoning is not None else "answer")
        self._labelled = False
        self._pending = ""
        self._call: _NativeCall | None = None
        self._ids = random.Random(seed) if seed is not None else None
        self._calls = 0
        self._out: list[Event] = []
        sinks: list = []
        if self.native:
            sinks.append(_Strip())
        elif calling is not None:
            sinks.append(_JsonCall(calling, self._start_call, self._emit))
        if hide_specials and reasoning is not None and reasoning.specials:
            sinks.append(_Hide(reasoning))
        self._sinks = sinks

    @property
    def calls(self) -> int:
        """Calls started so far."""
        return self._calls

    # -- input --------------------------------------------------------------------------------------------

    def feed(self, piece: str) -> list[Event]:
        self._pending += piece
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        rest, self._pending = self._pending, ""
        if self._state == "reasoning":
            self._reason(rest)
        elif self._state == "call" and self._call.index is None:
            self._content(CALL_BEGIN + rest)   # no name yet: no call
        elif self._state == "call":
            self._call.abandon(rest)   # cut short: a call with the arguments it had
        elif self._state != "closed":
            self._content(rest)
        self._content("", final=True)
        return self._take()

    # -- the state machine --------------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        """Advance over `_pending` as far as it can be told apart; False when it needs more text."""
        p = self._pending
        if self._state == "first":   # whitespace before the first channel is not the answer
            text = p.lstrip("\n ")
            if text.startswith(BEGIN):
                self._open_channel(text[len(BEGIN):])
                return True
            if not text or BEGIN.startswith(text):
                return False
            self._state = "answer"
            return True
        if self._state == "reasoning":
            if not self._labelled:   # the channel's name ("thought\n") is not reasoning
                heads = (LABEL + "\n", LABEL + END)
                if not final and any(len(p) < len(h) and h.startswith(p) for h in heads):
                    return False
                if p.startswith(LABEL) and p[len(LABEL):].startswith(("\n", END)):
                    self._pending = p = p[len(LABEL):].removeprefix("\n")
                self._labelled = True
            i, marker = _first(p, (END, CALL_BEGIN))
            if marker is None:
                keep = _partial_suffix(p, (END, CALL_BEGIN))
                self._reason(p[:len(p) - keep])
                self._pending = p[len(p) - keep:]
                return False
            self._reason(p[:i])
            self._pending = p[i + len(END):] if marker == END else p[i:]   # a call is the answer's
            self._state = "answer"
            return True
        if self._state == "answer":
            markers = ((BEGIN,) if self.reasoning is not None else ()) + ((CALL_BEGIN, RESPONSE_BEGIN)
                                                                          if self.native else ())
            i, marker = _first(p, markers)
            if marker is None:
                keep = _partial_suffix(p, markers)
                self._content(p[:len(p) - keep])
                self._pending = p[len(p) - keep:]
                return False
            self._content(p[:i])
            self._pending = p[i + len(marker):]
            if marker == BEGIN:
                self._open_channel(self._pending)
            elif marker == RESPONSE_BEGIN:   # the model hands over to the tool: nothing after is the answer
                self._state, self._pending = "closed", ""
            else:
                self._state, self._call = "call", _NativeCall(self.calling, self._start_call, self._emit)
            return True
        if self._state == "call":
            status, used = self._call.feed(p)
            self._pending = p[used:]
            if status == "more":
                return False
            if status == "failed":   # no call after all: its text is content
                self._content(CALL_BEGIN + p[:used])
            self._state, self._call = "answer", None
            return True
        self._pending = ""   # closed
        return False

    def _open_channel(self, rest: str) -> None:
        self._state, self._pending, self._labelled, self.thought = "reasoning", rest, False, True

    # -- outputs ------------------------------------------------------------------------------------------

    def _reason(self, text: str) -> None:
        if text:
            self._out.append(ReasoningDelta(text))

    def _content(self, text: str, final: bool = False) -> None:
        for sink in self._sinks:
            text = sink.feed(text, final)
        if text:
            self._out.append(ContentDelta(text))

    def _emit(self, event: Event) -> None:
        self._out.append(event)

    def _start_call(self, name: str) -> int:
        index, self._calls = self._calls, self._calls + 1
        hexid = f"{self._ids.getrandbits(96):024x}" if self._ids is not None else uuid.uuid4().hex[:24]
        self._out.append(ToolCallStart(index, f"call_{hexid}", name))
        return index

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out


class _NativeCall:
    """One Gemma 4 call after its <|tool_call>: `call:NAME{args}<tool_call|>`, the arguments turned into JSON
    as they come. `feed(text)` reads from the call's unread text -> (status, characters used): "more" (all of
    it read, waiting for more), "done" (the call ended there), "failed" (no call: the characters used are to
    be read as content). Each step reads only what it can decide, so any cut gives the same output."""

    def __init__(self, calling: ToolCalling, start, emit):
        self.names = {t.name for t in calling.tools}
        self.start, self.emit = start, emit
        self.index: int | None = None
        self.stack: list[str] = []      # open "{" / "[" of the arguments
        self.expect = "value"           # value | key | after | colon | end | string | keystring | skip
        self.first = True               # the open object/array has no item yet
        self.args: list[str] = []
        self.key: list[str] = []

    def feed(self, text: str) -> tuple[str, int]:
        if self.index is None:
            if len(text) < len(_CALL_HEAD):
                return ("more", 0) if _CALL_HEAD.startswith(text) else ("failed", 0)
            if not text.startswith(_CALL_HEAD):
                return "failed", 0
            j = len(_CALL_HEAD)
            while j < len(text) and text[j] in _NAME_CHARS:
                j += 1
            if j == len(text):
                return "more", 0
            name = text[len(_CALL_HEAD):j]
            if text[j] != "{" or name not in self.names:
                return "failed", j
            self.index = self.start(name)
            return self._args(text, j)
        return self._args(text, 0)

    def abandon(self, rest: str) -> None:
        """The output ended inside the call: it keeps the arguments sent (and a string's held end)."""
        if self.expect == "string":
            self._out(json.dumps(rest, ensure_ascii=False)[1:-1])

    def _out(self, s: str) -> None:
        if s:
            self.args.append(s)
            self.emit(ToolCallDelta(self.index, s))

    def _args(self, text: str, i: int) -> tuple[str, int]:
        n = len(text)
        while i < n:
            e = self.expect
            if e == "skip":   # broken arguments: the rest of the call is dropped, up to its end
                k = text.find(CALL_END, i)
                if k < 0:
                    return "more", n - _partial_suffix(text[i:], (CALL_END,))
                return "done", k + len(CALL_END)
            if e in ("string", "keystring"):
                k = text.find(DELIM, i)
                stop = k if k >= 0 else n - _partial_suffix(text[i:], (DELIM,))
                chunk = text[i:stop]
                if e == "string":
                    self._out(json.dumps(chunk, ensure_ascii=False)[1:-1])
                else:
                    self.key.append(chunk)
                if k < 0:
                    return "more", stop
                i = k + len(DELIM)
                if e == "string":
                    self._out('"')
                    self.expect = "after"
                else:
                    self._out(json.dumps("".join(self.key), ensure_ascii=False) + ": ")
                    self.key, self.expect = [], "colon"
                continue
            if text[i].isspace() and e != "end":
                i += 1
                continue
            if e == "end":
                if len(text) - i < len(CALL_END) and CALL_END.startswith(text[i:]):
                    return "more", i
                if text.startswith(CALL_END, i):
                    self.emit(ToolCallDone(self.index, "".join(self.args)))
                    return "done", i + len(CALL_END)
                self.expect = "skip"
                continue
            if e == "colon":
                if text[i] != ":":
                    self.expect = "skip"
                    continue
                self.expect, i = "value", i + 1
                continue
            if e == "after":   # after an item: "," or the close
                close = "}" if self.stack[-1] == "{" else "]"
                if text[i] == ",":
                    self.expect, i = ("key" if close == "}" else "item"), i + 1
                elif text[i] == close:
                    i = self._close(i)
                else:
                    self.expect = "skip"
                continue
            if e in ("key", "item") and text[i] == ("}" if e == "key" else "]"):   # a trailing comma
                i = self._close(i)
                continue
            if e == "key":
                if text.startswith(DELIM, i):
                    self._sep()
                    self.expect, i = "keystring", i + len(DELIM)
                    continue
                if len(text) - i < len(DELIM) and DELIM.startswith(text[i:]):
                    return "more", i
                k = i
                while k < n and text[k] not in ":{}[],<":
                    k += 1
                if k == n:
                    return "more", i
                key = text[i:k].strip()
                if text[k] != ":" or not key:
                    self.expect = "skip"
                    continue
                self._sep()
                self._out(json.dumps(key, ensure_ascii=False) + ": ")
                self.expect, i = "value", k + 1
                continue
            # a value ("value": after a colon or at the top; "item": in an array), read once it can be told
            if len(text) - i < len(DELIM) and DELIM.startswith(text[i:]):
                return "more", i
            c, k = text[i], i
            if text.startswith(DELIM, i):
                out, k, self.expect = '"', i + len(DELIM), "string"
            elif c in "{[":
                out, k, self.expect = c, i + 1, ("key" if c == "{" else "item")
            elif not self.stack:   # the arguments are one object
                self.expect = "skip"
                continue
            else:
                while k < n and not (text[k] in ",}]" or text[k].isspace()):
                    k += 1
                if k == n:
                    return "more", i
                try:
                    out, self.expect = json.dumps(json.loads(text[i:k]), ensure_ascii=False), "after"
                except ValueError:
                    self.expect = "skip"
                    continue
            if e == "item":
                self._sep()
            self._out(out)
            if c in "{[" and k == i + 1:
                self.stack.append(c)
                self.first = True
            i = k
        return "more", n

    def _sep(self) -> None:
        """", " before an item that is not its object's or array's first."""
        if not self.first:
            self._out(", ")
        self.first = False

    def _close(self, i: int) -> int:
        self._out("}" if self.stack.pop() == "{" else "]")
        self.first = False
        self.expect = "after" if self.stack else "end"
        return i + 1


class _Strip:
    """Content stripped at both ends, as it streams: leading whitespace dropped, trailing whitespace held
    until more text follows it."""

    def __init__(self):
        self.started, self.held = False, ""

    def feed(self, text: str, final: bool) -> str:
        if final:
            return ""
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        text = self.held + text
        core = text.rstrip()
        self.held = text[len(core):]
        return core


class _Hide:
    """Special-token texts removed from content; the end of a piece that may still begin one waits."""

    def __init__(self, fmt: ReasoningFormat):
        self.specials, self.pattern = fmt.specials, fmt.hidden
        self.longest = max(map(len, self.specials))
        self.held = ""

    def feed(self, text: str, final: bool) -> str:
        text = self.held + text
        keep = 0 if final else self._partial(text)
        out, self.held = text[:len(text) - keep], text[len(text) - keep:]
        return self.pattern.sub("", out)

    def _partial(self, text: str) -> int:
        for n in range(min(len(text), self.longest - 1), 0, -1):
            tail = text[-n:]
            j = bisect.bisect_right(self.specials, tail)   # the first special after `tail` starts with it if any does
            if j < len(self.specials) and self.specials[j].startswith(tail):
                return n
        return 0


class _JsonCall:
    """The JSON call format: the answer is held while it may still be a call; once it cannot (its first
    character is no "{" or fence, its object closed and more text followed, its brackets do not match, or the
    object is no call) everything held flows as content. At the end a held call becomes the call."""

    def __init__(self, calling: ToolCalling, start, emit):
        self.calling, self.start, self.emit = calling, start, emit
        self.held: str | None = ""      # None: decided, content
        self.stack: list[str] = []
        self.scanned = 0                # characters of the stripped text scanned
        self.in_string = self.escaped = False
        self.closed_at: int | None = None

    def feed(self, text: str, final: bool) -> str:
        if self.held is None:
            return text
        self.held += text
        if final:
            held, self.held = self.held, None
            call = self.calling.json_call(held)
            if call is None:
                return held
            index = self.start(call[0])
            arguments = json.dumps(call[1], ensure_ascii=False)
            self.emit(ToolCallDelta(index, arguments))
            self.emit(ToolCallDone(index, arguments))
            return ""
        if self._cannot_be_call():
            held, self.held = self.held, None
            return held
        return ""

    def _cannot_be_call(self) -> bool:
        body = self.held.lstrip()
        if not body:
            return False
        if body[0] == "`":
            return not (body.startswith("```") or "```".startswith(body))
        if body[0] != "{":
            return True
        while self.scanned < len(body):
            c = body[self.scanned]
            self.scanned += 1
            if self.closed_at is not None:
                if not c.isspace():
                    return True
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.stack.append(c)
            elif c in "}]":
                if not self.stack or "{[".index(self.stack.pop()) != "}]".index(c):
                    return True
                if not self.stack:
                    self.closed_at = self.scanned
                    if self.calling.json_call(body[:self.scanned]) is None:
                        return True
        return False


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest of `markers` in `text`: (its position, it), or (-1, None)."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, None)


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `markers` (and may still become it)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best
