"""OpenAI request bodies (validated strictly: a string is not a number) and the response objects.

Unknown fields are ignored, as OpenAI-compatible servers do; known fields that we cannot honour
(logit_bias, suffix, ...) are rejected with a 400 that names them.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.request import TokenLogprob
from ..engine.sampling_params import (
    MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, MIN_TOP_P, REPETITION_PENALTY_RANGE, SamplingParams,
)
from ..engine.structured.structured_output import GrammarKind, StructuredOutput
from ..errors import UserInputError
from ..models.tokenizer import Tokenizer


class ApiError(Exception):
    """An error response in OpenAI's format."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                             405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
                             499: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _doc(default: Any = None, **schema: Any) -> Any:
    """A field whose valid range is stated in the OpenAPI schema only (for clients and fuzzers): the
    checks themselves stay in SamplingParams and the handlers, which name the parameter at fault."""
    return Field(default, json_schema_extra=schema)


_STOP = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 256},
                   {"type": "array", "maxItems": MAX_STOP_STRINGS,
                    "items": {"type": "string", "minLength": 1, "maxLength": 256}}, {"type": "null"}]}


# -- nested request objects: typed, so that a wrong type anywhere is a 400 naming its path (not a handler's
# TypeError), and described in the OpenAPI schema, so that fuzzers and clients see every nested field.
class StreamOptions(_Strict):
    include_usage: bool = False


class URLRef(_Strict):
    url: str
    detail: str | None = None   # OpenAI's image detail level (ignored: the processor's resolution is fixed)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURLPart(_Strict):
    type: Literal["image_url"]
    image_url: URLRef | str


class AudioURLPart(_Strict):
    type: Literal["audio_url"]
    audio_url: URLRef | str


class VideoURLPart(_Strict):
    type: Literal["video_url"]
    video_url: URLRef | str


class InputAudio(_Strict):
    data: str             # base64 audio
    format: str | None = None


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImageURLPart | AudioURLPart | VideoURLPart | InputAudioPart,
                        Field(discriminator="type")]


class CalledFunction(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"   # OpenAI sends the JSON text; an object is taken too


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Strict):
    """One chat message. Which roles may carry what (content, tool_calls, name) is checked by parse_chat."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionSpec(_Strict):
    name: str = Field(json_schema_extra={"pattern": "^[A-Za-z0-9_.-]{1,64}$"})   # checked by parse_tools
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema (compiled into the grammar)
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaSpec(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] | None = None   # None: text
    json_schema: JsonSchemaSpec | None = None


class KVTransferParams(_Strict):
    """Set by `gemmaserve router` only (server/disagg.py checks the values)."""
    transfer_id: str | None = None
    prefill_url: str | None = None


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = _doc(minimum=1)
    temperature: float | None = _doc(minimum=0)   # (any temperature >= 0, as vLLM takes: OpenAI stops at 2)
    top_p: float | None = _doc(minimum=MIN_TOP_P, maximum=1)
    n: int = _doc(1, minimum=1, maximum=MAX_N)
    stop: str | list[str] | None = Field(None, json_schema_extra=lambda s: s.update(_STOP))
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = _doc(minimum=-2, maximum=2)
    frequency_penalty: float | None = _doc(minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extensions
    top_k: int | None = _doc(minimum=0)
    # disaggregated serving: set by `gemmaserve router` only (server/disagg.py)
    kv_transfer_params: KVTransferParams | None = None
    min_p: float | None = _doc(minimum=0, maximum=1)
    repetition_penalty: float | None = _doc(minimum=REPETITION_PENALTY_RANGE[0], maximum=REPETITION_PENALTY_RANGE[1])
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    speculative: bool = True   # false: no drafts for this request (the server's --speculative-config)
    request_timeout: float | None = _doc(exclusiveMinimum=0)   # seconds from arrival; only shortens the server's
    response_format: ResponseFormat | None = None   # text, json_object or json_schema (also on completions, as vLLM)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(json_schema_extra={"minLength": 1, "minItems": 1})
    logprobs: int | None = _doc(minimum=0, maximum=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(json_schema_extra={"minItems": 1})
    logprobs: bool = False
    top_logprobs: int | None = _doc(minimum=0, maximum=MAX_LOGPROBS)
    max_completion_tokens: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None   # e.g. {"enable_thinking": true} (Gemma 4)
    include_reasoning: bool = True   # reasoning models: reasoning apart as reasoning_content (false: in content)
    # OpenAI's knob; Gemma 4 thinks or does not: "none" turns thinking off, any other level on (an explicit
    # chat_template_kwargs enable_thinking wins). A level above "none" on a model that cannot think is a 400, as
    # OpenAI answers.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def message_dicts(self) -> list[dict]:
        """The messages as parse_chat reads them (OpenAI's shape, as validated; unknown fields dropped)."""
        return [m.model_dump(exclude_none=True, by_alias=True) for m in self.messages]

    def tool_dicts(self) -> tuple[list[dict] | None, str | dict | None]:
        """(tools, tool_choice) as parse_tools reads them."""
        tools = None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]
        choice = self.tool_choice
        return tools, choice.model_dump() if isinstance(choice, NamedToolChoice) else choice


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's shape): a `prompt` as /v1/completions reads it, or chat `messages` through the chat
    template as /v1/chat/completions renders them (images and audio expanded to their tokens), not both."""
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, json_schema_extra={"minItems": 1})
    add_special_tokens: bool = True   # a prompt's BOS (messages: the template writes its own)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's shape): token ids back to text, special tokens included."""
    model: str | None = None
    tokens: list[int]


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)   # a directory under --lora-root


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str = Field(min_length=1, max_length=256)


class TranscriptionRequest(BaseModel):
    """The form fields of /v1/audio/transcriptions and /v1/audio/translations (multipart: every value arrives as
    text, so values are converted, not strict). `file` is read apart (the upload)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] = "json"
    temperature: float = _doc(0.0, minimum=0)   # (as the chat routes: any temperature >= 0)
    stream: bool = False
    timestamp_granularities: list[Literal["segment"]] = Field(default_factory=lambda: ["segment"],
                                                              alias="timestamp_granularities[]")
    seed: int | None = None
    max_tokens: int | None = _doc(minimum=1)   # per 30 s clip (vLLM's extension); default: 448
    request_timeout: float | None = _doc(exclusiveMinimum=0)
    kv_transfer_params: None = None   # (no disaggregated transcriptions)


_OBJECT = re.compile(r"a valid dictionary or (instance of \w+|object to extract fields from)")


def parse(cls: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc, body) from None


def validation_error(exc: ValidationError, body: dict) -> ApiError:
    """Pydantic's errors as one 400 that names the path in the body (`messages[0].content[1].type`) and the
    top-level field as its param. A value that fits no member of a union is reported once per member, each
    location naming its member (`content.str`, `content.list[...]`): a location is read as the path into the
    body itself, and the error kept is the one that reached deepest (the member the value was meant for);
    members failing at the same depth are joined."""
    found: list[tuple[list[str | int], str, object]] = []
    for err in exc.errors():
        path: list[str | int] = []
        node: object = body
        loc = err["loc"]
        for i, key in enumerate(loc):
            if isinstance(node, dict) and key == node.get("type") and i + 1 < len(loc) and loc[i + 1] in node:
                continue   # a discriminated union's tag, not the field of that name (a thinking block's `thinking`)
            if (isinstance(node, dict) and isinstance(key, str) and key in node) or (
                    isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node)):
                path.append(key)
                node = node[key]
        ctx = err.get("ctx") or {}
        if err["type"] == "missing":
            path.append(err["loc"][-1])
            msg = "field required"
        elif err["type"] == "union_tag_invalid":   # a discriminated union (content parts): name the tag's field
            field = ctx["discriminator"].strip("'")
            path.append(field)
            msg, node = f"must be one of {ctx['expected_tags']}", node.get(field) if isinstance(node, dict) else node
        elif err["type"] == "union_tag_not_found":
            path.append(ctx["discriminator"].strip("'"))
            msg = "field required"
        else:   # pydantic's names for our classes mean nothing to a client
            msg = _OBJECT.sub("an object", err["msg"])
        found.append((path, msg, node if err["type"] not in ("missing", "union_tag_not_found") else ...))
    depth = max(len(p) for p, _, _ in found)
    deepest = [f for f in found if len(f[0]) == depth]
    path, _, got = deepest[0]
    msgs = list(dict.fromkeys(m for p, m, _ in deepest if p == path))
    lead = "Input should be "
    msg = (lead + " or ".join(m[len(lead):] for m in msgs) if all(m.startswith(lead) for m in msgs)
           else "; ".join(msgs))
    where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" if k.isidentifier() else f"[{k!r}]"
                    for k in path).lstrip(".") or "body"
    shown = "" if got is ... else f" (got {got!r:.80})"
    return ApiError(400, f"{where}: {msg}{shown}", param=str(path[0]) if path else None)


def reject_unsupported(req: CompletionRequest | ChatRequest) -> None:
    def no(cond: bool, param: str, what: str) -> None:
        if cond:
            raise ApiError(400, f"{param}: {what} is not supported", param=param)

    no(bool(req.logit_bias), "logit_bias", "biasing logits")
    t = req.request_timeout
    if t is not None and not (0 < t < float("inf")):
        raise ApiError(400, f"request_timeout must be a positive number of seconds, got {t!r}", param="request_timeout")
    if isinstance(req, CompletionRequest):
        no(req.suffix is not None, "suffix", "insertion (suffix)")
        no(req.best_of is not None and req.best_of != req.n, "best_of", "best_of other than n")
        no(req.echo and req.logprobs is not None, "echo", "echo with logprobs (prompt logprobs)")
    else:   # checked here, not by SamplingParams, whose message would name its own `logprobs`
        k = req.top_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k}",
                           param="top_logprobs")
        if k is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")


_FIELDS = {f for f in SamplingParams.__dataclass_fields__}


def sampling_params(req: CompletionRequest | ChatRequest, max_tokens: int) -> SamplingParams:
    if isinstance(req, ChatRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    values = dict(max_tokens=max_tokens, n=req.n, stop=req.stop, seed=req.seed, logprobs=logprobs,
                  temperature=1.0 if req.temperature is None else req.temperature,
                  top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                  min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty or 0.0,
                  frequency_penalty=req.frequency_penalty or 0.0,
                  repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                  ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids or [],
                  skip_special_tokens=req.skip_special_tokens, speculative=req.speculative,
                  structured_output=response_format(req.response_format))
    try:
        return SamplingParams(**values)
    except UserInputError as exc:
        raise ApiError(400, str(exc), param=_param_of(str(exc))) from None


def response_format(fmt: ResponseFormat | None) -> StructuredOutput | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema (always enforced,
    whatever its `strict` says: a schema we were given is a schema we keep)."""
    if fmt is None or fmt.type in (None, "text"):
        return None
    try:
        if fmt.type == "json_object":
            return StructuredOutput(GrammarKind.JSON)
        spec = fmt.json_schema
        if spec is None or spec.schema_ is None:
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema (an object)",
                           param="response_format")
        return StructuredOutput.json_schema(spec.schema_)
    except UserInputError as exc:
        raise ApiError(400, f"response_format: {exc}", param="response_format") from None


def _param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0]
    return word if word in _FIELDS else None


# -- responses ---------------------------------------------------------------------------------------
def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(tok: Tokenizer, lps: list[TokenLogprob], offset: int) -> dict:
    """The legacy completions format: parallel lists."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = tok.token_text(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({tok.token_text(t): p for t, p in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok: Tokenizer, lps: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = tok.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                        for lp in lps]}

