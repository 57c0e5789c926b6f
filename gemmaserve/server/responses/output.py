"""Output events (output_parser.py) -> a response's output items, and the typed stream events that announce them:

    reasoning  {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text"}]}
               response.output_item.added, .content_part.added, .reasoning_text.delta ... .done, .content_part.done,
               .output_item.done
    message    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text", ...}]}
               the same with response.output_text.delta / .done
    call       {"type": "function_call", "call_id", "name", "arguments"}
               response.output_item.added, .function_call_arguments.delta / .done, .output_item.done

An item opens with its first event and closes when an item of another kind begins or the output ends. The
non-streamed response is built the same way (its events unsent), so both give the same items.
"""

from __future__ import annotations

import copy
import uuid

from ..output_parser import ContentDelta, Event, ReasoningDelta, ToolCallDelta, ToolCallDone, ToolCallStart


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None   # the item still receiving text (reasoning or message)
        self._calls: dict[int, dict] = {}   # open calls by their event index

    def apply(self, event: Event) -> list[dict]:
        """The stream events (without sequence numbers) that `event` makes."""
        if isinstance(event, ReasoningDelta):
            return self._text("reasoning", event.text)
        if isinstance(event, ContentDelta):
            return self._text("message", event.text)
        if isinstance(event, ToolCallStart):
            out = self._close_text()
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": event.id,
                    "name": event.name, "arguments": ""}
            self._calls[event.index] = item
            return out + [self._add(item)]
        item = self._calls[event.index]
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        if isinstance(event, ToolCallDelta):
            item["arguments"] += event.arguments
            return [{"type": "response.function_call_arguments.delta", **where, "delta": event.arguments}]
        assert isinstance(event, ToolCallDone)
        del self._calls[event.index]
        item["status"] = "completed"
        return [{"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]},
                self._done(item)]

    def finish(self) -> list[dict]:
        """Close what is open. An output with nothing in it gets an empty message (the answer was empty)."""
        out = self._close_text()
        if not self.items:
            out += self._text("message", "") + self._close_text()
        for k, item in list(self._calls.items()):   # a call cut short (no ToolCallDone): closed as it stands
            out += self.apply(ToolCallDone(k, item["arguments"]))
        return out

    def _text(self, kind: str, text: str) -> list[dict]:
        out = []
        if self._open is None or self._open["type"] != kind:
            out += self._close_text()
            out += self._open_text(kind)
        item = self._open
        part = item["content"][0]
        part["text"] += text
        if not text:
            return out
        where = {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}
        if kind == "reasoning":
            return out + [{"type": "response.reasoning_text.delta", **where, "delta": text}]
        return out + [{"type": "response.output_text.delta", **where, "delta": text, "logprobs": []}]

    def _open_text(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self._add(item)   # announced empty, as OpenAI does: its part follows
        item["content"].append(part)
        self._open = item
        return [added, {"type": "response.content_part.added", "item_id": item["id"],
                        "output_index": self.items.index(item), "content_index": 0, "part": copy.deepcopy(part)}]

    def _close_text(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        part = item["content"][0]
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}
        done = ({"type": "response.reasoning_text.done", **where, "text": part["text"]} if item["type"] == "reasoning"
                else {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []})
        return [done, {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)}, self._done(item)]

    def _add(self, item: dict) -> dict:
        self.items.append(item)
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": copy.deepcopy(item)}

    def _done(self, item: dict) -> dict:
        return {"type": "response.output_item.done", "output_index": self.items.index(item),
                "item": copy.deepcopy(item)}
