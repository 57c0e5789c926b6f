"""A Responses request -> the chat request that the chat pipeline prepares (`ChatServing.prepare`), and input
items (a request's, or a finished response's output items) -> the chat messages a conversation holds.

A stored response keeps its conversation as chat messages, built from its output items by the same
translation a client's echoed items go through: a continuation by `previous_response_id` and one that sends
the whole conversation render the same prompt.
"""

from __future__ import annotations

from pydantic import TypeAdapter, ValidationError

from ..protocol import ApiError, ChatRequest
from .protocol import (
    ResponsesContentPart, ResponsesFunctionCall, ResponsesFunctionCallOutput, ResponsesInputAudio,
    ResponsesInputImage, ResponsesInputItem, ResponsesMessage, ResponsesRequest,
)

_ITEMS = TypeAdapter(list[ResponsesInputItem])
_EFFORT = {"xhigh": "high"}   # Gemma 4 thinks or does not: any level above "none" is on
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512   # OpenAI's bounds


def check_supported(req: ResponsesRequest) -> None:
    """400s for what the request asks that this server cannot do (rather than silently doing otherwise)."""
    def no(cond: bool, param: str, what: str) -> None:
        if cond:
            raise ApiError(400, f"{param}: {what} is not supported", param=param)

    no(bool(req.background), "background", "running a response in the background")
    no(bool(req.top_logprobs), "top_logprobs", "returning logprobs")
    no(req.truncation == "auto", "truncation", "dropping input items to fit the context (\"auto\")")
    meta = req.metadata or {}
    if len(meta) > METADATA_PAIRS or any(len(k) > METADATA_KEY or len(v) > METADATA_VALUE for k, v in meta.items()):
        raise ApiError(400, f"metadata: at most {METADATA_PAIRS} pairs, keys of at most {METADATA_KEY} characters and "
                            f"values of at most {METADATA_VALUE}", param="metadata")


def output_items(raw: list[dict]) -> list:
    """A response's output items (dicts) read as input items, the form a client sends them back in."""
    return _ITEMS.validate_python(raw)


def chat_messages(items: str | list, calls: dict[str, str]) -> list[dict]:
    """Input items -> chat messages. `calls` (call_id -> function name) holds the calls made earlier in the
    conversation and gains this input's: a function_call_output must answer one of them. Reasoning items are
    dropped: Gemma's transcripts never hold an earlier turn's thinking."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    assistant_open = False   # the last message is an assistant's to which calls that follow belong
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, ResponsesMessage):
            out.append({"role": item.role, "content": _content(item.content, where)})
            assistant_open = item.role == "assistant"
        elif isinstance(item, ResponsesFunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            calls[item.call_id] = item.name
            if assistant_open:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                assistant_open = True
        elif isinstance(item, ResponsesFunctionCallOutput):
            name = calls.get(item.call_id)
            if name is None:
                raise ApiError(400, f"{where}.call_id: no function_call with call_id {item.call_id!r} comes before "
                                    "this output (in the input or the previous response)", param="input")
            out.append({"role": "tool", "tool_call_id": item.call_id, "name": name,
                        "content": _content(item.output, where + ".output")})
            assistant_open = False
    return out


def _content(content: str | list, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    return [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]


def _part(part: ResponsesContentPart, where: str) -> dict:
    if isinstance(part, ResponsesInputImage):
        if part.image_url is None:
            raise ApiError(400, f"{where}: an input_image needs an image_url (a data: URL); file_id is not supported",
                           param="input")
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    if isinstance(part, ResponsesInputAudio):
        return {"type": "input_audio", "input_audio": part.input_audio.model_dump(exclude_none=True)}
    return {"type": "text", "text": part.refusal if part.type == "refusal" else part.text}


def calls_in(conversation: tuple[dict, ...] | list[dict]) -> dict[str, str]:
    """call_id -> function name of every call a conversation's assistant messages made."""
    return {c["id"]: c["function"]["name"] for m in conversation for c in m.get("tool_calls") or ()}


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatRequest:
    """The chat request of `messages` (instructions first) with the request's sampling, tools and formats."""
    if req.instructions is not None:
        messages = [{"role": "system", "content": req.instructions}] + messages
    if not messages:
        raise ApiError(400, "input: give the input (a string or a list of items), or a previous_response_id",
                       param="input")
    body: dict = {"model": req.model, "messages": messages, "temperature": req.temperature, "top_p": req.top_p,
                  "top_k": req.top_k, "seed": req.seed, "max_completion_tokens": req.max_output_tokens,
                  "parallel_tool_calls": req.parallel_tool_calls, "user": req.user,
                  "request_timeout": req.request_timeout}
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                     "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        body["response_format"] = ({"type": fmt.type} if fmt.type != "json_schema" else {
            "type": "json_schema", "json_schema": fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)})
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None:
        body["reasoning_effort"] = _EFFORT.get(effort, effort)
    try:
        return ChatRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:   # (what the Responses body allows, the chat body does: not expected)
        raise ApiError(400, f"input: {exc.errors()[0]['msg']}", param="input") from None
