"""A Messages request -> the OpenAI-shaped ChatRequest that ChatServing prepares (one prompt path for both APIs).

    system (a string or text blocks)      -> a system message (blocks joined by newlines)
    user text / image blocks              -> a user message of text and image_url parts (base64 -> a data: URL)
    user tool_result blocks               -> `tool` messages, named by the tool_use they answer, in place
    assistant text / tool_use blocks      -> an assistant message with content and tool_calls
    assistant thinking blocks             -> dropped (Gemma's templates keep no earlier turn's thoughts)
    tools (name, description, input_schema), tool_choice auto / any / tool / none, disable_parallel_tool_use
                                          -> tools, tool_choice auto / required / the named function / none,
                                             parallel_tool_calls
    thinking enabled / adaptive / disabled -> chat_template_kwargs enable_thinking (Gemma 4 thinks or does not:
                                             budget_tokens is not enforced)
    stop_sequences, max_tokens, temperature, top_p, top_k, metadata.user_id -> stop, max_tokens, ..., user
    output_config.format (a JSON schema)  -> response_format json_schema

What the chat path cannot say is a 400 here: a tool_result that answers no earlier tool_use, a tool_use of a tool
not offered, a block in the wrong role, and a final assistant turn (Anthropic continues it; our template always
opens a new turn)."""

from __future__ import annotations

from ..protocol import ApiError, ChatRequest, parse
from ..reasoning import ReasoningFormat
from .protocol import (
    Base64ImageSource, CountTokensRequest, ImageBlockParam, MessageParam, MessagesRequest, RedactedThinkingBlockParam,
    TextBlockParam, ThinkingBlockParam, ThinkingConfigDisabled, ToolChoiceAny, ToolChoiceAuto, ToolChoiceNone,
    ToolChoiceTool, ToolResultBlockParam, ToolUseBlockParam,
)


def to_chat_request(req: CountTokensRequest, reasoning: ReasoningFormat | None) -> ChatRequest:
    """The chat request of `req` (a MessagesRequest, or a count_tokens body: then without sampling);
    `reasoning`: the served model's thought channel (thinking needs one)."""
    messages = _system(req.system) + _messages(req.messages, {t.name for t in req.tools or ()})
    body: dict = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool):
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if choice is not None:
        body["tool_choice"] = {ToolChoiceAuto: "auto", ToolChoiceAny: "required", ToolChoiceNone: "none"}.get(
            type(choice)) or {"type": "function", "function": {"name": choice.name}}
    if req.thinking is not None:
        on = not isinstance(req.thinking, ThinkingConfigDisabled)
        if on and reasoning is None:
            raise ApiError(400, "thinking: this model does not think (its tokenizer has no thought channel)",
                           param="thinking")
        body["chat_template_kwargs"] = {"enable_thinking": on}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for ours, theirs in (("stop", req.stop_sequences), ("temperature", req.temperature), ("top_p", req.top_p),
                             ("top_k", req.top_k), ("user", req.metadata.user_id if req.metadata else None)):
            if theirs is not None:
                body[ours] = theirs
        fmt = req.output_config.format if req.output_config else None
        if fmt is not None and req.tools and not isinstance(choice, ToolChoiceNone):
            raise ApiError(400, "output_config.format cannot be combined with tools", param="output_config")
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    return parse(ChatRequest, body)


def _system(system: str | list[TextBlockParam] | None) -> list[dict]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(b.text for b in system)
    return [{"role": "system", "content": text}]


def _messages(messages: list[MessageParam], offered: set[str]) -> list[dict]:
    if messages[-1].role == "assistant":
        raise ApiError(400, f"messages[{len(messages) - 1}]: a final assistant turn (prefill) is not supported: the "
                            "answer always starts a new turn", param="messages")
    out: list[dict] = []
    calls: dict[str, str] = {}   # tool_use id -> the tool's name (what a tool_result answers)
    for i, m in enumerate(messages):
        blocks = [TextBlockParam(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            out.append(_assistant(blocks, i, offered, calls))
        else:
            out.extend(_user(blocks, i, calls))
    return out


def _assistant(blocks: list, i: int, offered: set[str], calls: dict[str, str]) -> dict:
    text, tool_calls = [], []
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(b, TextBlockParam):
            text.append(b.text)
        elif isinstance(b, ToolUseBlockParam):
            if b.name not in offered:
                raise ApiError(400, f"{where}: tool_use names tool {b.name!r}, which is not among the tools",
                               param="messages")
            if b.id in calls:
                raise ApiError(400, f"{where}: tool_use id {b.id!r} is used twice", param="messages")
            calls[b.id] = b.name
            tool_calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        elif not isinstance(b, ThinkingBlockParam | RedactedThinkingBlockParam):
            raise ApiError(400, f"{where}: an assistant turn holds text, tool_use and thinking blocks, not "
                                f"{b.type}", param="messages")
    message: dict = {"role": "assistant", "content": "".join(text)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _user(blocks: list, i: int, calls: dict[str, str]) -> list[dict]:
    """A user turn's blocks in order: text and images gather into user messages, each tool_result is a tool
    message of its own."""
    out: list[dict] = []
    parts: list[dict] = []
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(b, TextBlockParam | ImageBlockParam):
            parts.append(_part(b))
        elif isinstance(b, ToolResultBlockParam):
            if b.tool_use_id not in calls:
                raise ApiError(400, f"{where}: tool_result answers tool_use id {b.tool_use_id!r}, which no earlier "
                                    "assistant turn made", param="messages")
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            content = [_part(p) for p in b.content] if isinstance(b.content, list) else [_part(
                TextBlockParam(type="text", text=b.content))]
            if b.is_error:   # the template has no error flag: the model reads it
                content.insert(0, {"type": "text", "text": "Error: "})
            out.append({"role": "tool", "name": calls[b.tool_use_id], "tool_call_id": b.tool_use_id,
                        "content": content})
        else:
            raise ApiError(400, f"{where}: a user turn holds text, image and tool_result blocks, not {b.type}",
                           param="messages")
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _part(b: TextBlockParam | ImageBlockParam) -> dict:
    if isinstance(b, TextBlockParam):
        return {"type": "text", "text": b.text}
    src = b.source
    url = f"data:{src.media_type};base64,{src.data}" if isinstance(src, Base64ImageSource) else src.url
    return {"type": "image_url", "image_url": {"url": url}}
