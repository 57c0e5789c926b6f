"""Parser events -> Anthropic's server-sent events, each `event: TYPE` + `data: JSON`:

    message_start (the message, content empty) · ping
    per block: content_block_start · content_block_delta (text_delta | thinking_delta | input_json_delta;
               a thinking block's signature_delta last) · content_block_stop
    message_delta (stop_reason, stop_sequence, usage.output_tokens) · message_stop
    on failure mid-stream: an `error` event, and nothing after it

Blocks open when an event of another kind arrives and close when the next one opens, so thinking, text and each
tool call are blocks of their own, indexed in order."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from ..output_parser import ContentDelta, Event, ReasoningDelta, ToolCallDelta, ToolCallDone, ToolCallStart


def sse_event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def tool_input(arguments: str) -> dict:
    """A call's arguments (OpenAI's JSON text) as Anthropic's `input` object; a call cut short (its JSON
    unfinished) has none."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def signature(thinking: str) -> str:
    """A thinking block's `signature`: opaque to clients, which must send it back unchanged. Ours is a digest of
    the thought: earlier thoughts are not read back (Gemma's templates drop them), so nothing is verified."""
    return hashlib.sha256(thinking.encode()).hexdigest()


@dataclass
class BlockWriter:
    """Tracks the open content block, writes the events of each parser event, and keeps the blocks they make
    (`blocks`: the message's content, so a whole answer is these same blocks, in the same order)."""

    index: int = -1
    kind: str | None = None        # "thinking" | "text" | "tool_use" | None (no block open)
    blocks: list[dict] = field(default_factory=list)
    _json: str = ""                # the open tool_use block's arguments so far

    def write(self, ev: Event) -> list[str]:
        if isinstance(ev, ReasoningDelta):
            return self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""}) + [
                self._delta({"type": "thinking_delta", "thinking": ev.text})]
        if isinstance(ev, ContentDelta):
            return self._into("text", {"type": "text", "text": ""}) + [self._delta({"type": "text_delta",
                                                                                    "text": ev.text})]
        if isinstance(ev, ToolCallStart):   # every call is a new block, even after another call
            return self.close() + self._open("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name,
                                                          "input": {}})
        if isinstance(ev, ToolCallDelta):
            return [self._delta({"type": "input_json_delta", "partial_json": ev.arguments})]
        if isinstance(ev, ToolCallDone):
            return self.close()
        raise TypeError(f"not a parser event: {ev!r}")

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        block, out = self.blocks[-1], []
        if self.kind == "thinking":
            block["signature"] = signature(block["thinking"])
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        elif self.kind == "tool_use":
            block["input"] = tool_input(self._json)
        self.kind, self._json = None, ""
        return out + [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _into(self, kind: str, block: dict) -> list[str]:
        return [] if self.kind == kind else self.close() + self._open(kind, block)

    def _open(self, kind: str, block: dict) -> list[str]:
        self.index += 1
        self.kind = kind
        self.blocks.append(dict(block))
        return [sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def _delta(self, delta: dict) -> str:
        block = self.blocks[-1]
        if delta["type"] == "thinking_delta":
            block["thinking"] += delta["thinking"]
        elif delta["type"] == "text_delta":
            block["text"] += delta["text"]
        elif delta["type"] == "input_json_delta":
            self._json += delta["partial_json"]
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


def message_blocks(events: list[Event]) -> list[dict]:
    """A whole answer's events as the message's content blocks (what its stream's blocks add up to)."""
    writer = BlockWriter()
    for ev in events:
        writer.write(ev)
    writer.close()
    return writer.blocks
