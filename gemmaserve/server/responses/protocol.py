"""The request body of POST /v1/responses (OpenAI's Responses API), validated strictly as the chat routes' bodies
are: a wrong type anywhere is a 400 naming its path; unknown fields are ignored.

Class names carry a `Responses` prefix: they become components of the OpenAPI document, beside the chat models'.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _doc(default: Any = None, **schema: Any) -> Any:
    """A field whose valid range is stated in the OpenAPI schema only (checked where the value is used)."""
    return Field(default, json_schema_extra=schema)


def _by_type(tags: tuple[str, ...], default: str | None = None) -> Discriminator:
    """A union chosen by its `type` field; an item without one is a `default` (OpenAI's easy message). A type that
    names no member is reported as a discriminated union's bad tag (protocol.validation_error names the field)."""
    def kind(value: Any) -> str:
        if not isinstance(value, dict):
            return default or tags[0]   # that member then says "should be an object"
        t = value.get("type", default)
        return t if isinstance(t, str) else ""

    return Discriminator(kind, custom_error_type="union_tag_invalid", custom_error_context={
        "tag": "?", "discriminator": "'type'", "expected_tags": ", ".join(repr(t) for t in tags)})


# -- content parts ---------------------------------------------------------------------------------------------
class ResponsesInputText(_Strict):
    type: Literal["input_text"]
    text: str


class ResponsesInputImage(_Strict):
    type: Literal["input_image"]
    image_url: str | None = None   # a data: URL (the server fetches nothing)
    file_id: str | None = None     # (no file store: refused)
    detail: Literal["low", "high", "auto", "original"] | None = None   # ignored: the processor's resolution is fixed


class ResponsesAudioData(_Strict):
    data: str   # base64 audio
    format: str | None = None


class ResponsesInputAudio(_Strict):
    type: Literal["input_audio"]
    input_audio: ResponsesAudioData


class ResponsesOutputText(_Strict):
    """An earlier answer's text, as a client sends a response's output items back."""
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None


class ResponsesRefusal(_Strict):
    type: Literal["refusal"]
    refusal: str


_PARTS = ("input_text", "input_image", "input_audio", "output_text", "refusal")
ResponsesContentPart = Annotated[Union[
    Annotated[ResponsesInputText, Tag("input_text")], Annotated[ResponsesInputImage, Tag("input_image")],
    Annotated[ResponsesInputAudio, Tag("input_audio")], Annotated[ResponsesOutputText, Tag("output_text")],
    Annotated[ResponsesRefusal, Tag("refusal")]], _by_type(_PARTS)]


# -- input items -----------------------------------------------------------------------------------------------
class ResponsesMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesContentPart]
    id: str | None = None
    status: str | None = None


class ResponsesFunctionCall(_Strict):
    """A call the model made (an earlier response's output item, sent back)."""
    type: Literal["function_call"]
    call_id: str = _doc(minLength=1)
    name: str
    arguments: str   # JSON text, as the model's output gave it
    id: str | None = None
    status: str | None = None


class ResponsesFunctionCallOutput(_Strict):
    """A call's result, for the call of the same call_id (in this input or earlier in the conversation)."""
    type: Literal["function_call_output"]
    call_id: str = _doc(minLength=1)
    output: str | list[ResponsesContentPart]
    id: str | None = None
    status: str | None = None


class ResponsesSummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ResponsesReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ResponsesReasoningItem(_Strict):
    """An earlier response's reasoning, sent back: taken and dropped (Gemma's transcripts hold no reasoning)."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ResponsesSummaryText] = Field(default_factory=list)
    content: list[ResponsesReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
ResponsesInputItem = Annotated[Union[
    Annotated[ResponsesMessage, Tag("message")], Annotated[ResponsesFunctionCall, Tag("function_call")],
    Annotated[ResponsesFunctionCallOutput, Tag("function_call_output")],
    Annotated[ResponsesReasoningItem, Tag("reasoning")]], _by_type(_ITEMS, "message")]


# -- tools, formats, reasoning ---------------------------------------------------------------------------------
class ResponsesFunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(json_schema_extra={"pattern": "^[A-Za-z0-9_.-]{1,64}$"})   # checked by tools.parse_tools
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema (compiled into the grammar)
    strict: bool | None = None


class ResponsesFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesTextConfig(_Strict):
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None   # (no knob for it in Gemma: ignored)


class ResponsesReasoning(_Strict):
    # Gemma 4 thinks or does not: "none" turns thinking off, any other level on
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None   # (the reasoning itself is returned, no summary)


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[ResponsesInputItem] | None = None
    instructions: str | None = None   # a system message first; not carried on to a later response
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = _doc(minimum=1)
    temperature: float | None = _doc(minimum=0)
    top_p: float | None = _doc(exclusiveMinimum=0, maximum=1)
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoning | None = None
    metadata: dict[str, str] | None = _doc(maxProperties=16)
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    # vLLM-style extensions
    top_k: int | None = _doc(minimum=0)
    seed: int | None = None
    request_timeout: float | None = _doc(exclusiveMinimum=0)   # seconds from arrival; only shortens the server's
