"""POST /v1/chat/completions: messages (text, images, audio) through the chat template, tools and response
formats, answered as JSON or server-sent events."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.media.images import decode_data_url, require_data_url
from ..engine.input_processor import LoadedMedia
from ..engine.sampling_params import SamplingParams
from ..engine.structured.structured_output import INSTALL_HINT, TOOL_RESPONSE
from ..errors import UserInputError
from ..models.chat_template import ChatMessage, parse_chat
from ..models.multimodal import Modality
from .protocol import ApiError, ChatRequest, chat_logprobs, now, parse, reject_unsupported, sampling_params
from .output_parser import (ContentDelta, Event, OutputParser, ParsedOutput, ReasoningDelta, ToolCallDelta,
                            ToolCallStart, fold)
from .reasoning import ReasoningFormat
from .async_engine import Generation
from .serving import Prompt, ServingCommon, sse
from .tools import ToolCalling, ToolFormat, parse_tools


class ChatServing:
    """Holds the shared request plumbing (`ServingCommon`) and, through it, the engine's client."""

    def __init__(self, common: ServingCommon):
        self.common, self.client, self.model = common, common.client, common.model

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: ChatRequest = parse(ChatRequest, await self.common.read_json(request))
        job = await self.prepare(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = await self.start(job, rid, arrival)
        if req.stream:
            return sse(self._stream_chat(rid, job, outputs), outputs)
        finals = await self.common.collect(request, outputs)
        choices = []
        for (_, k), out in sorted(finals.items()):
            c = out.outputs[0]
            read = job.read(c.text, c.finish_reason)
            message: dict = {"role": "assistant", "content": read.content}
            if read.tool_calls:
                message["tool_calls"] = read.tool_calls
            if job.answer.reasoning is not None:
                message["reasoning_content"] = read.reasoning
            choices.append({"index": k, "message": message, "finish_reason": read.finish_reason,
                            "stop_reason": c.stop_reason,
                            "logprobs": chat_logprobs(self.model.tokenizer, c.logprobs)
                            if c.logprobs is not None else None})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now(),
                             "model": self.common.answering(req), "choices": choices,
                             "usage": self.common.usage([job.prompt], finals, job.answer.opened)})

    async def prepare(self, req: ChatRequest) -> "ChatJob":
        """A parsed chat request -> its prompt, sampling, tools and checked engine requests (400s for anything
        wrong). Other APIs (Responses, Messages) translate their requests into a ChatRequest and come here."""
        lora = self.common.check_model(req.model)
        reject_unsupported(req)
        calling = self._tool_calling(req)
        prompt, items = await asyncio.to_thread(self.chat_prompt, req.message_dicts(), calling, self._template_kwargs(req))
        ids = prompt.ids
        limit = self.client.info.max_model_len
        if len(ids) >= limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens; the messages take "
                                f"{len(ids)}", param="messages", code="context_length_exceeded")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, max_tokens if max_tokens is not None else limit - len(ids))
        if calling is not None:
            try:
                grammar = calling.structured_output()
            except ImportError:
                raise ApiError(400, INSTALL_HINT, param="tools") from None
            native = calling.format is ToolFormat.NATIVE   # its markers are special tokens: keep them to parse
            params = params.replace(structured_output=grammar, skip_special_tokens=params.skip_special_tokens and not native,
                                    stop=params.stop + ([TOOL_RESPONSE] if native else []))
        show_special = not params.skip_special_tokens
        if self.model.reasoning is not None and params.structured_output is not None:   # the grammar starts where the
            so = dataclasses.replace(params.structured_output,                    # reasoning ends
                                     reasoning=(self.model.reasoning.begin_id, self.model.reasoning.end_id))
            params = params.replace(structured_output=so)
        reasoning = self.model.reasoning if req.include_reasoning else None
        if reasoning is not None:   # its markers are special tokens: kept to split, removed from answers after
            params = params.replace(skip_special_tokens=False)
        checked = await self.common.validate([prompt], params, "messages",
                                             "tools" if calling is not None else "response_format", [items], lora)
        opened = reasoning is not None and _opens_channel(ids, reasoning)
        return ChatJob(req, prompt, params, calling, _Answers(reasoning, show_special, opened), checked)

    async def render(self, req: ChatRequest) -> Prompt:
        """The prompt `prepare` builds for `req` (tools and template kwargs included), unchecked against the
        engine: what token counts read (Messages' count_tokens)."""
        self.common.check_model(req.model)
        calling = self._tool_calling(req)
        prompt, _ = await asyncio.to_thread(self.chat_prompt, req.message_dicts(), calling, self._template_kwargs(req))
        return prompt

    async def start(self, job: "ChatJob", rid: str, arrival: float) -> Generation:
        """Admit the prepared request and start generating: (prompt index, output) pairs (429 when full)."""
        with self.common.admit(job.params.n) as admission:
            return await self.common.start(job.req, rid, job.checked, self.common.deadline(arrival, job.req),
                                           admission)

    def _stream_chat(self, rid: str, job: "ChatJob", outputs) -> AsyncIterator[str]:
        """Each choice's output read as it comes (`OutputParser`): reasoning as `reasoning_content` deltas, the
        answer as `content`, tool calls as OpenAI streams them (a call's first chunk has its index, id, type and
        name; later ones its index and argument fragments). Only text that may still be a JSON-format call
        waits."""
        req = job.req
        parsers: dict[int, OutputParser] = {}

        def choices(_: int, c) -> list[dict]:
            if c.index not in parsers:
                parsers[c.index] = job.parser()
            parser = parsers[c.index]
            events = parser.feed(c.delta_text) + (parser.finish() if c.finished else [])
            lp = chat_logprobs(self.model.tokenizer, c.delta_logprobs) if c.delta_logprobs else None
            deltas = chat_deltas(events)
            if lp and not deltas:
                deltas = [{"content": ""}]
            out = [{"index": c.index, "delta": d, "logprobs": lp if k == 0 else None, "finish_reason": None}
                   for k, d in enumerate(deltas)]
            if c.finished:   # OpenAI closes each choice with an empty delta
                out.append({"index": c.index, "delta": {}, "logprobs": None,
                            "finish_reason": _finish(parser.calls > 0, c.finish_reason), "stop_reason": c.stop_reason})
            return out

        opening = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for k in range(job.params.n)]
        return self.common.stream(rid, "chat.completion.chunk", req, [job.prompt], outputs, choices, opening,
                                  job.answer.opened)

    def chat_prompt(self, raw_messages: list, calling: ToolCalling | None = None,
                     template_kwargs: dict | None = None) -> tuple[Prompt, list]:
        """Messages -> the prompt through the chat template (tools offered as `calling` says, `template_kwargs`
        passed to it), and its images and audio in place. Decodes them and tokenises: called on a worker
        thread."""
        inputs = self.model.inputs
        try:
            messages, media = parse_chat(raw_messages, {m: lay.placeholder for m, lay in inputs.layouts.items()})
            tools = None
            if calling is not None and calling.format is ToolFormat.NATIVE:
                tools = [t.openai() for t in calling.offered]
            elif calling is not None:
                messages = [ChatMessage("system", calling.preamble())] + messages
            loaded = self._chat_media(media) if media else None
            ids = self.model.chat.encode(messages, (lambda text: inputs.expand(text, loaded)) if media else None, tools,
                                   template_kwargs)
            items = inputs.place(ids, loaded) if media else []
        except UserInputError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return Prompt(self.model.tokenizer.decode(ids, skip_special_tokens=False), ids), items

    def _chat_media(self, media: list[tuple[Modality, object]]) -> LoadedMedia:
        """What the encoders read of each image, audio and video part: data: URLs and `input_audio` objects only
        (the server opens no file and fetches no URL), within the server's limits."""
        images = [x for m, x in media if m is Modality.IMAGE]
        audio = [x for m, x in media if m is Modality.AUDIO]
        videos = [x for m, x in media if m is Modality.VIDEO]
        config = self.common.config
        image_limits, audio_limits, video_limits = config.image_limits, config.audio_limits, config.video_limits
        for given, most, what in ((images, image_limits.max_images, "images"), (audio, audio_limits.max_clips, "audio inputs"),
                                  (videos, video_limits.max_videos, "videos")):
            if len(given) > most:
                raise UserInputError(f"{len(given)} {what}; at most {most} per request")
        for i, url in enumerate(images):   # refuse before decoding anything
            require_data_url(url, f"image {i}", "PNG/JPEG/WebP")
        for i, a in enumerate(audio):
            if not isinstance(a, dict):   # an input_audio object holds its bytes
                require_data_url(a, f"audio {i}", "WAV/FLAC/OGG/MP3")
        for i, url in enumerate(videos):
            require_data_url(url, f"video {i}", "MP4/WebM/MKV")
        return self.model.inputs.load_media([decode_data_url(u, image_limits, f"image {i}") for i, u in enumerate(images)],
                                             audio, videos, image_limits, audio_limits, video_limits)

    def _tool_calling(self, req: ChatRequest) -> ToolCalling | None:
        tools, choice = req.tool_dicts()
        calling = parse_tools(tools, choice, req.parallel_tool_calls, self.model.tokenizer, self.model.chat.renders_tools)
        if calling is not None and req.response_format is not None and req.response_format.type not in (None, "text"):
            raise ApiError(400, "response_format cannot be combined with tools", param="response_format")
        return calling

    def _template_kwargs(self, req: ChatRequest) -> dict | None:
        """chat_template_kwargs, with reasoning_effort read as Gemma 4's on/off enable_thinking."""
        kwargs = req.chat_template_kwargs
        if req.reasoning_effort is None or (self.model.reasoning is None and req.reasoning_effort == "none"):
            return kwargs
        if self.model.reasoning is None:
            raise ApiError(400, f"reasoning_effort: {self.model.name} does not think (its tokenizer has no thought "
                                "channel)", param="reasoning_effort")
        return {"enable_thinking": req.reasoning_effort != "none", **(kwargs or {})}


@dataclass(frozen=True)
class _Answers:
    """How a request's output text becomes its answer: the reasoning split off (reasoning models; `opened`: the
    prompt opened the thought channel), and what is left of special tokens removed unless the request asked for
    them."""

    reasoning: ReasoningFormat | None
    show_special: bool
    opened: bool = False


@dataclass(frozen=True)
class ChatAnswer:
    """A finished completion read: its reasoning, its answer text and its tool calls (OpenAI's shape)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict]
    finish_reason: str | None


@dataclass(frozen=True)
class ChatJob:
    """A chat request made ready to generate (`ChatServing.prepare`): its prompt, sampling, tools, how its
    outputs read as answers, and the engine's checked requests."""

    req: ChatRequest
    prompt: Prompt
    params: SamplingParams
    calling: ToolCalling | None
    answer: _Answers
    checked: list

    def parser(self, seed: str | None = None) -> OutputParser:
        """A new parser for one choice's output (state is per choice: never share one)."""
        return OutputParser(self.answer.reasoning, self.calling, self.answer.opened, not self.answer.show_special,
                            seed)

    def reader(self, seed: str | None = None) -> "AnswerReader":
        """A new reader for one choice's output: its events as they come, and the answer they fold into."""
        return AnswerReader(self.parser(seed))

    def read(self, text: str, finish_reason: str | None, seed: str | None = None) -> ChatAnswer:
        """A finished completion's text -> its reasoning, answer and tool calls ("tool_calls" finish then):
        the streamed events folded, so a streamed answer and a whole one agree."""
        reader = self.reader(seed)
        reader.feed(text)
        return reader.finish(finish_reason)[1]


@dataclass
class AnswerReader:
    """One choice's output read as it comes (the Responses and Messages streams): the parser's events of each
    piece, and at the end the answer all of them fold into, the very answer `ChatJob.read` gives the whole text."""

    parser: OutputParser
    events: list[Event] = dataclasses.field(default_factory=list)

    def feed(self, piece: str) -> list[Event]:
        out = self.parser.feed(piece)
        self.events += out
        return out

    def finish(self, finish_reason: str | None) -> tuple[list[Event], ChatAnswer]:
        out = self.parser.finish()
        self.events += out
        parsed: ParsedOutput = fold(self.events, self.parser.thought, self.parser.content_optional)
        return out, ChatAnswer(parsed.reasoning, parsed.content, parsed.tool_calls,
                               _finish(bool(parsed.tool_calls), finish_reason))


def chat_deltas(events: list[Event]) -> list[dict]:
    """Parser events -> chat.completion.chunk deltas: runs of one kind merged (a call's start and its arguments
    of one step in one entry, which every client's accumulator reads)."""
    deltas: list[dict] = []
    for e in events:
        if isinstance(e, (ReasoningDelta, ContentDelta)):
            key = "reasoning_content" if isinstance(e, ReasoningDelta) else "content"
            if deltas and list(deltas[-1]) == [key]:
                deltas[-1][key] += e.text
            else:
                deltas.append({key: e.text})
        elif isinstance(e, (ToolCallStart, ToolCallDelta)):
            if not deltas or list(deltas[-1]) != ["tool_calls"]:
                deltas.append({"tool_calls": []})
            calls = deltas[-1]["tool_calls"]
            if isinstance(e, ToolCallStart):
                calls.append({"index": e.index, "id": e.id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}})
            elif calls and calls[-1]["index"] == e.index:
                calls[-1]["function"]["arguments"] += e.arguments
            else:
                calls.append({"index": e.index, "function": {"arguments": e.arguments}})
    return deltas


def _finish(called: bool, finish_reason: str | None) -> str | None:
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def _opens_channel(ids: list[int], fmt: ReasoningFormat) -> bool:
    """Whether the prompt ends inside the thought channel (a template that opens it for the model)."""
    begin = max((i for i, t in enumerate(ids) if t == fmt.begin_id), default=-1)
    return begin >= 0 and fmt.end_id not in ids[begin:]
