"""Anthropic Messages request bodies, validated strictly (a string is not a number), unknown fields ignored.

The shapes follow Anthropic's API (the `anthropic` client's `*Param` types): content blocks are a discriminated
union on `type`, so a wrong block is a 400 naming its path (`messages[1].content[0].type`). Class names differ
from protocol.py's (they share the OpenAPI document's components)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...engine.sampling_params import MIN_TOP_P


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _doc(default: Any = None, **schema: Any) -> Any:
    """A field whose range is stated in the OpenAPI schema only; the checks stay in SamplingParams and the
    handlers, which name the parameter at fault."""
    return Field(default, json_schema_extra=schema)


class TextBlockParam(_Strict):
    type: Literal["text"]
    text: str


class Base64ImageSource(_Strict):
    type: Literal["base64"]
    media_type: str   # image/png, image/jpeg, image/webp (the decoder says which it takes)
    data: str


class URLImageSource(_Strict):
    type: Literal["url"]
    url: str          # data: URLs only: the server fetches nothing


ImageSource = Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]


class ImageBlockParam(_Strict):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlockParam(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ToolResultPart = Annotated[TextBlockParam | ImageBlockParam, Field(discriminator="type")]


class ToolResultBlockParam(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultPart] = ""
    is_error: bool = False


class ThinkingBlockParam(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(_Strict):
    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[TextBlockParam | ImageBlockParam | ToolUseBlockParam | ToolResultBlockParam
                              | ThinkingBlockParam | RedactedThinkingBlockParam, Field(discriminator="type")]


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolParam(_Strict):
    name: str = Field(json_schema_extra={"pattern": "^[A-Za-z0-9_.-]{1,64}$"})   # checked by parse_tools
    description: str | None = None
    input_schema: dict[str, Any]   # a JSON schema (compiled into the call grammar)
    type: Literal["custom"] | None = None


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingConfigEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(json_schema_extra={"minimum": 1})   # not enforced: Gemma 4 thinks or does not


class ThinkingConfigAdaptive(_Strict):
    type: Literal["adaptive"]


class ThinkingConfigDisabled(_Strict):
    type: Literal["disabled"]


ThinkingConfig = Annotated[ThinkingConfigEnabled | ThinkingConfigAdaptive | ThinkingConfigDisabled,
                           Field(discriminator="type")]


class JSONOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JSONOutputFormat | None = None   # the answer's JSON schema (enforced, as response_format is)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None   # (accepted; Gemma has no such knob)


class MessagesMetadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: what the prompt of a /v1/messages request would take."""
    model: str
    messages: list[MessageParam] = Field(json_schema_extra={"minItems": 1})
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""
    max_tokens: int = Field(json_schema_extra={"minimum": 1})   # required, as Anthropic's
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = _doc(minimum=0)
    top_p: float | None = _doc(minimum=MIN_TOP_P, maximum=1)
    top_k: int | None = _doc(minimum=0)
    metadata: MessagesMetadata | None = None
    output_config: OutputConfig | None = None


MESSAGES_MODELS: tuple[type[BaseModel], ...] = (MessagesRequest, CountTokensRequest)   # their OpenAPI schemas
