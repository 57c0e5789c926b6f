"""Tool calling: OpenAI's `tools` / `tool_choice` in the model's own call format, constrained by a grammar.

Which format is read from the vocabulary, not the model's name:

    NATIVE  the tokenizer has Gemma 4's tool tokens. The checkpoint's chat template declares the tools;
            the model writes  <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>  (xgrammar's
            "gemma_4" structural tag constrains the arguments to each tool's JSON schema).
    JSON    no tool tokens (Gemma 3, whose templates know no tools). A system preamble lists the tools;
            a call is one JSON object  {"name": NAME, "parameters": {...}}  (Google's suggested form).

    tool_choice   "none": tools not offered      "auto": free text or calls (calls constrained once begun:
                  NATIVE; JSON: parsed if the whole answer is a call)      "required" / a named function:
                  the answer is a call (to that function), its arguments valid against the schema.

Calls are read from the text (specials kept: the markers are special tokens) as it streams, by
`output_parser.py`, and returned as `tool_calls` with finish_reason "tool_calls"; arguments are a JSON string,
as OpenAI's are. `parse` reads a finished text at once.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass

from ..engine.structured.structured_output import (
    TOOL_CALL_BEGIN as CALL_BEGIN, TOOL_CALL_END as CALL_END, TOOL_RESPONSE as RESPONSE_BEGIN,
    TOOL_STRING as STRING_DELIM, GrammarKind, StructuredOutput,
)
from ..models.tokenizer import Tokenizer
from .protocol import ApiError

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_NATIVE_CALL = re.compile(re.escape(CALL_BEGIN) + r"call:([A-Za-z0-9_.-]+)(\{.*?\})" + re.escape(CALL_END), re.S)
_SCALAR = re.compile(r"[^,}\]\s]+")   # a number, true, false or null in Gemma's argument syntax
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


class ToolFormat(enum.Enum):
    NATIVE = "native"
    JSON = "json"


def tool_format(tokenizer: Tokenizer, template_declares_tools: bool) -> ToolFormat:
    """NATIVE needs both the tool tokens and a chat template that declares tools (nothing else can
    offer tools in the model's own syntax)."""
    native = template_declares_tools and all(tokenizer.token_to_id(t) is not None
                                             for t in (CALL_BEGIN, CALL_END, STRING_DELIM))
    return ToolFormat.NATIVE if native else ToolFormat.JSON


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCalling:
    tools: tuple[Tool, ...]
    choice: str                 # "auto" | "required" | "named"
    named: str | None
    parallel: bool
    format: ToolFormat

    @property
    def offered(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if self.named is None or t.name == self.named)

    def structured_output(self) -> StructuredOutput | None:
        if self.format is ToolFormat.NATIVE:
            import xgrammar

            choice = ({"type": "function", "function": {"name": self.named}} if self.choice == "named"
                      else self.choice)
            tag = xgrammar.get_model_structural_tag("gemma_4", tools=[t.openai() for t in self.tools],
                                                    tool_choice=choice, reasoning=False,
                                                    parallel_tool_calls=self.parallel)
            return StructuredOutput(GrammarKind.STRUCTURAL_TAG, tag.model_dump_json())
        if self.choice == "auto":
            return None   # free text or a call: parsed afterwards
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.offered]
        return StructuredOutput.json_schema(calls[0] if len(calls) == 1 else {"anyOf": calls})

    def preamble(self) -> str:
        """The system text that offers the tools when the chat template does not (JSON format)."""
        must = "You must call one of them." if self.choice != "auto" else "Call one only when it helps."
        return ("You can call these functions. To call one, reply with only a JSON object "
                '{"name": <function name>, "parameters": {<argument>: <value>, ...}} and no other text. '
                f"{must}\n\n" + json.dumps([t.openai()["function"] for t in self.offered], indent=1))

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """The finished text -> (content, tool calls in OpenAI's shape)."""
        names = {t.name for t in self.tools}
        if self.format is ToolFormat.NATIVE:
            calls = []
            for m in _NATIVE_CALL.finditer(text):
                if m.group(1) in names:
                    try:
                        calls.append(_call(m.group(1), gemma_arguments(m.group(2))))
                    except ValueError:
                        continue   # cut short (max_tokens): left in the content
            content = _NATIVE_CALL.sub("", text) if calls else text
            content = content.split(RESPONSE_BEGIN)[0].strip()
            return (content or None), calls
        call = self.json_call(text)
        return (None, [_call(*call)]) if call is not None else (text, [])

    def json_call(self, text: str) -> tuple[str, dict] | None:
        """(name, arguments) when the whole text is one call in the JSON format, else None."""
        body = text.strip()
        fenced = _FENCE.match(body)
        try:
            obj = json.loads(fenced.group(1) if fenced else body)
        except json.JSONDecodeError:
            return None
        args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
        name = obj.get("name") if isinstance(obj, dict) else None   # any JSON: a list is no name
        if isinstance(name, str) and name in {t.name for t in self.tools} and isinstance(args, dict):
            return obj["name"], args
        return None


def _call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tools(tools: list | None, choice: object, parallel: bool, tokenizer: Tokenizer,
                template_declares_tools: bool) -> ToolCalling | None:
    """The request's tools and tool_choice, checked; None when no tool is offered."""
    if choice is not None and not tools and choice != "none":
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if not tools or choice == "none":
        return None
    parsed = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} with "
                                "a name of 1-64 letters, digits, _ . -", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ApiError(400, f"tools[{i}].function.description must be a string", param="tools")
        parsed.append(Tool(fn["name"], description, params))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools must have distinct names", param="tools")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if named not in names:
            raise ApiError(400, f"tool_choice names function {named!r}, which is not among the tools",
                           param="tool_choice")
        choice = "named"
    elif choice not in ("auto", "required"):
        raise ApiError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", param="tool_choice")
    return ToolCalling(tuple(parsed), choice, named, parallel, tool_format(tokenizer, template_declares_tools))


def gemma_arguments(text: str) -> dict:
    """Gemma 4's argument syntax -> a dict: keys bare, strings between <|"|> markers, otherwise JSON
    (numbers, true, false, null, nested {} and [])."""
    value, end = _value(text, 0)
    if end != len(text.rstrip()) or not isinstance(value, dict):
        raise ValueError("arguments are not one object")
    return value


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _items(text: str, i: int, close: str, read, out):
    """The comma-separated items of an object or array opened at text[i], up to `close`: `read`
    returns (item, end); a (key, value) item goes into a dict, anything else onto a list."""
    i = _skip(text, i + 1)
    while not text.startswith(close, i):
        item, i = read(text, i)
        if isinstance(out, dict):
            out[item[0]] = item[1]
        else:
            out.append(item)
        i = _skip(text, i)
        if text.startswith(",", i):
            i = _skip(text, i + 1)
        elif not text.startswith(close, i):
            raise ValueError(f"expected ',' or '{close}'")
    return out, i + 1


def _member(text: str, i: int):
    """key:value inside an object; keys are bare or <|"|>-quoted."""
    if text.startswith(STRING_DELIM, i):
        key, i = _value(text, i)
    else:
        colon = text.find(":", i)
        if colon < 0:
            raise ValueError("a key without a value")
        key, i = text[i:colon].strip(), colon
    i = _skip(text, i)
    if not text.startswith(":", i):
        raise ValueError("expected ':'")
    value, i = _value(text, i + 1)
    return (key, value), i


def _value(text: str, i: int):
    i = _skip(text, i)
    if text.startswith(STRING_DELIM, i):
        end = text.find(STRING_DELIM, i + len(STRING_DELIM))
        if end < 0:
            raise ValueError("unterminated string")
        return text[i + len(STRING_DELIM):end], end + len(STRING_DELIM)
    if text.startswith("{", i):
        return _items(text, i, "}", _member, {})
    if text.startswith("[", i):
        return _items(text, i, "]", _value, [])
    m = _SCALAR.match(text, i)
    if m is None:
        raise ValueError("expected a value")
    return json.loads(m.group(0)), m.end()
