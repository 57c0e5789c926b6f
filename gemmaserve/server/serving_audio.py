"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's speech-to-text endpoints over a model with an
audio encoder (Gemma 4 E2B/E4B).

    multipart form: file (WAV, FLAC, OGG, MP3; any rate or channels), model, language (ISO-639-1), prompt,
    response_format (json, text, srt, vtt, verbose_json), temperature, stream, seed, max_tokens (per clip)
    -> the upload decoded and cut into the encoder's clips (at most 30 s, each cut in a pause)
    -> one chat request per clip, run together: the clip and an instruction (transcribe in the language asked,
       or translate into English), thinking off
    -> the clips' texts in order: {"text"}, plain text, subtitles (one cue per clip), or verbose_json with a
       segment per clip; with stream, `transcript.text.delta` events in order, then `transcript.text.done`

The model writes text only: what a thinking model writes in its thought channel is never part of a transcript.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..engine.media.audio import decode_audio_bytes, split_clips
from ..engine.input_processor import LoadedMedia
from ..engine.media.items import MediaInput
from ..engine.request import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..errors import UserInputError
from ..models.chat_template import ChatMessage
from ..models.multimodal import Modality
from .async_engine import DeadlineExceeded, EngineDeadError
from .protocol import ApiError, TranscriptionRequest, parse
from .serving import Prompt, ServingCommon, as_api_error, raise_if_failed, sse

CLIP_MAX_TOKENS = 448        # what one 30 s clip may write (speech runs ~3 words a second); max_tokens overrides
FORM_OVERHEAD = 1 << 20      # bytes of a multipart body beyond its file

# ISO-639-1 codes users send as `language`, and the names the instruction gives the model
LANGUAGES = {
    "af": "Afrikaans", "ar": "Arabic", "az": "Azerbaijani", "be": "Belarusian", "bg": "Bulgarian", "bn": "Bengali",
    "bs": "Bosnian", "ca": "Catalan", "cs": "Czech", "cy": "Welsh", "da": "Danish", "de": "German", "el": "Greek",
    "en": "English", "es": "Spanish", "et": "Estonian", "fa": "Persian", "fi": "Finnish", "fr": "French",
    "gl": "Galician", "he": "Hebrew", "hi": "Hindi", "hr": "Croatian", "hu": "Hungarian", "hy": "Armenian",
    "id": "Indonesian", "is": "Icelandic", "it": "Italian", "ja": "Japanese", "kk": "Kazakh", "kn": "Kannada",
    "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian", "mi": "Maori", "mk": "Macedonian", "mr": "Marathi",
    "ms": "Malay", "ne": "Nepali", "nl": "Dutch", "no": "Norwegian", "pl": "Polish", "pt": "Portuguese",
    "ro": "Romanian", "ru": "Russian", "sk": "Slovak", "sl": "Slovenian", "sr": "Serbian", "sv": "Swedish",
    "sw": "Swahili", "ta": "Tamil", "th": "Thai", "tl": "Tagalog", "tr": "Turkish", "uk": "Ukrainian", "ur": "Urdu",
    "vi": "Vietnamese", "zh": "Chinese",
}


@dataclass(frozen=True)
class _Clip:
    start: float          # seconds into the upload
    end: float
    prompt: Prompt
    items: list


class AudioServing:
    """Holds the shared request plumbing (`ServingCommon`) and, through it, the engine's client."""

    def __init__(self, common: ServingCommon):
        self.common, self.client, self.model = common, common.client, common.model

    async def transcriptions(self, request: Request) -> Response:
        return await self._speech_to_text(request, translate=False)

    async def translations(self, request: Request) -> Response:
        return await self._speech_to_text(request, translate=True)

    async def _speech_to_text(self, request: Request, translate: bool) -> Response:
        arrival = time.monotonic()
        req, data = await self._form(request)
        lora = self.common.check_model(req.model)
        layout = self.model.inputs.layouts.get(Modality.AUDIO)
        if layout is None:
            raise ApiError(400, f"model {self.model.name!r} does not take audio", param="file")
        language = None
        if req.language is not None and not translate:
            language = LANGUAGES.get(req.language.strip().lower())
            if language is None:
                raise ApiError(400, f"language must be an ISO-639-1 code (e.g. en, de, ja), got {req.language!r}",
                               param="language")
        if req.stream and req.response_format not in ("json", "text"):
            raise ApiError(400, "stream is supported with response_format json or text", param="stream")
        clips = await asyncio.to_thread(self._clips, data, layout, translate, language, req.prompt)
        limit = self.client.info.max_model_len
        max_tokens = req.max_tokens or CLIP_MAX_TOKENS
        longest = max(len(c.prompt.ids) for c in clips)
        if longest >= limit:
            raise ApiError(400, f"a clip's prompt takes {longest} tokens; this model's maximum context length is "
                                f"{limit}", param="file", code="context_length_exceeded")
        try:
            # a reasoning model's output keeps its special tokens: the thought channel is cut out by its markers
            params = SamplingParams(max_tokens=min(max_tokens, limit - longest), temperature=req.temperature,
                                    seed=req.seed, skip_special_tokens=self.model.reasoning is None)
        except UserInputError as exc:
            raise ApiError(400, str(exc)) from None
        checked = await self.common.validate([c.prompt for c in clips], params, "file", "file",
                                             [c.items for c in clips], lora)
        rid = f"trsc-{uuid.uuid4().hex}"
        with self.common.admit(len(clips)) as admission:
            outputs = await self.common.start(req, rid, checked, self.common.deadline(arrival, req), admission)
        if req.stream:
            return sse(self._stream_text(clips, outputs), outputs)
        finals = await self.common.collect(request, outputs)
        texts = [self._answer(finals[(i, 0)]) for i in range(len(clips))]
        text = " ".join(t for t in texts if t)
        fmt = req.response_format
        if fmt == "text":
            return PlainTextResponse(text + "\n")
        if fmt in ("srt", "vtt"):
            return PlainTextResponse(_subtitles(clips, texts, fmt), media_type="text/vtt" if fmt == "vtt" else
                                     "application/x-subrip")
        used = self._speech_usage(clips, finals)
        if fmt == "json":
            return JSONResponse({"text": text, "usage": used})
        segments = [{"id": i, "seek": round(c.start * 100), "start": round(c.start, 3), "end": round(c.end, 3),
                     "text": t, "tokens": list(finals[(i, 0)].outputs[0].token_ids), "temperature": req.temperature}
                    for i, (c, t) in enumerate(zip(clips, texts))]
        return JSONResponse({"task": "translate" if translate else "transcribe",
                             "language": "english" if translate else (language or "unspecified").lower(),
                             "duration": round(clips[-1].end, 3), "text": text, "segments": segments, "usage": used})

    async def _form(self, request: Request) -> tuple[TranscriptionRequest, bytes]:
        """The form fields and the uploaded file's bytes, within the upload limit (413 above it)."""
        limit = self.common.config.max_audio_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit + FORM_OVERHEAD:
            raise ApiError(413, f"request body is {declared} bytes; audio uploads are limited to {limit} bytes",
                           code="request_too_large")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "send the audio as multipart/form-data with a 'file' field", param="file")
        try:
            form = await request.form(max_files=1, max_fields=32, max_part_size=64 << 10)
        except Exception as exc:   # python-multipart's and starlette's errors for broken or oversized forms
            raise ApiError(400, f"invalid multipart form: {exc}", param="file") from None
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "the form needs a 'file' field holding the audio upload", param="file")
        fields: dict = {k: v for k, v in form.multi_items() if isinstance(v, str) and k != "timestamp_granularities[]"}
        grains = form.getlist("timestamp_granularities[]")
        if grains:
            fields["timestamp_granularities[]"] = list(grains)
        req = parse(TranscriptionRequest, fields)
        data = await upload.read(limit + 1)
        await upload.close()
        if len(data) > limit:
            raise ApiError(413, f"the audio file exceeds the limit of {limit} bytes", param="file",
                           code="request_too_large")
        if not data:
            raise ApiError(400, "the audio file is empty", param="file")
        return req, data

    def _clips(self, data: bytes, layout, translate: bool, language: str | None, context: str | None) -> list[_Clip]:
        """The upload decoded and cut into clips, each a prompt (the chat template over the clip and the instruction)
        with its item in place. Decodes and tokenises: called on a worker thread."""
        inputs = self.model.inputs
        rate = layout.processor.config.sampling_rate
        try:
            samples = decode_audio_bytes(data, rate, self.common.config.audio_limits, what="file")
            parts = split_clips(samples, layout.processor.config.max_samples, 2 * rate)
            instruction = _instruction(translate, language, context)
            message = ChatMessage("user", layout.placeholder + instruction)
            out, start = [], 0
            for k, part in enumerate(parts):
                encoded = layout.processor(part)
                if not encoded.num_tokens:
                    raise UserInputError(f"file is {1000 * len(part) / rate:.1f} ms long: too short for one audio "
                                         "token")
                loaded: LoadedMedia = {Modality.AUDIO: [MediaInput([encoded])]}
                ids = self.model.chat.encode([message], lambda text: inputs.expand(text, loaded))
                out.append(_Clip(start / rate, (start + len(part)) / rate,
                                 Prompt(self.model.tokenizer.decode(ids, skip_special_tokens=False), ids),
                                 inputs.place(ids, loaded)))
                start += len(part)
        except UserInputError as exc:
            raise ApiError(400, str(exc), param="file") from None
        return out

    async def _stream_text(self, clips: list[_Clip], outputs) -> AsyncIterator[str]:
        """`transcript.text.delta` events in clip order (a later clip's text waits for the earlier ones), then
        `transcript.text.done` with the whole text and usage."""
        finals: dict[tuple[int, int], RequestOutput] = {}
        sent, texts = 0, []

        def event(body: dict) -> str:
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        async with contextlib.aclosing(outputs):
            try:
                async for i, out in outputs:
                    raise_if_failed(out.outputs[0])
                    if out.outputs[0].finished:
                        finals[(i, 0)] = out
                    while sent < len(clips) and (sent, 0) in finals:   # the next clip in order is done
                        text = self._answer(finals[(sent, 0)])
                        lead = " " if texts and text else ""
                        texts.append(text)
                        if text:
                            yield event({"type": "transcript.text.delta", "delta": lead + text})
                        sent += 1
            except (ApiError, EngineDeadError, UserInputError, DeadlineExceeded) as exc:   # as ServingCommon.stream
                err = as_api_error(exc)
                self.common.metrics.http_errors.labels(str(err.status)).inc()
                yield event(err.body())
                return
        yield event({"type": "transcript.text.done", "text": " ".join(t for t in texts if t),
                     "usage": self._speech_usage(clips, finals)})
        yield "data: [DONE]\n\n"

    def _answer(self, out: RequestOutput) -> str:
        """A clip's text: the answer alone (a thinking model's thought channel and special tokens removed), on one
        line."""
        text = out.outputs[0].text
        if self.model.reasoning is not None:
            text = self.model.reasoning.clean(self.model.reasoning.split(text)[1])
        return " ".join(text.split())

    def _speech_usage(self, clips: list[_Clip], finals: dict[tuple[int, int], RequestOutput]) -> dict:
        audio = sum(it.length for c in clips for it in c.items)
        prompt = sum(len(c.prompt.ids) for c in clips)
        output = sum(len(o.outputs[0].token_ids) for o in finals.values())
        return {"type": "tokens", "input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output,
                "input_token_details": {"audio_tokens": audio, "text_tokens": prompt - audio}}


def _instruction(translate: bool, language: str | None, context: str | None) -> str:
    if translate:
        text = "Translate the speech above into English. Write only the English translation, as one paragraph."
    else:
        spoken = f" (spoken in {language})" if language else ""
        text = (f"Transcribe the speech above{spoken} exactly as it is said. Write only the transcription, as one "
                "paragraph, with numbers in digits.")
    if context and context.strip():
        text += f" It follows this text, which also shows the spelling to use: {context.strip()}"
    return "\n" + text


def _subtitles(clips: list[_Clip], texts: list[str], fmt: str) -> str:
    def stamp(seconds: float) -> str:
        ms = int(round(seconds * 1000))
        h, rest = divmod(ms, 3_600_000)
        m, rest = divmod(rest, 60_000)
        s, ms = divmod(rest, 1000)
        return f"{h:02d}:{m:02d}:{s:02d}{'.' if fmt == 'vtt' else ','}{ms:03d}"

    cues = [(c, t) for c, t in zip(clips, texts) if t]
    if fmt == "vtt":
        return "WEBVTT\n\n" + "".join(f"{stamp(c.start)} --> {stamp(c.end)}\n{t}\n\n" for c, t in cues)
    return "".join(f"{k}\n{stamp(c.start)} --> {stamp(c.end)}\n{t}\n\n" for k, (c, t) in enumerate(cues, 1))


