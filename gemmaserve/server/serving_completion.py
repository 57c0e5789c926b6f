"""POST /v1/completions: prompts (text or token ids, one or many) continued, as JSON or server-sent events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.sampling_params import SamplingParams
from .protocol import (
    ApiError, CompletionRequest, completion_logprobs, now, parse, reject_unsupported, sampling_params,
)
from .serving import Prompt, ServingCommon, sse

MAX_PROMPTS = 256            # prompts in one completions request
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


class CompletionServing:
    """Holds the shared request plumbing (`ServingCommon`) and, through it, the engine's client."""

    def __init__(self, common: ServingCommon):
        self.common, self.client, self.model = common, common.client, common.model

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: CompletionRequest = parse(CompletionRequest, await self.common.read_json(request))
        lora = self.common.check_model(req.model)
        reject_unsupported(req)
        prompts = await asyncio.to_thread(self._completion_prompts, req.prompt)
        params = sampling_params(req, req.max_tokens if req.max_tokens is not None else COMPLETIONS_MAX_TOKENS)
        checked = await self.common.validate(prompts, params, "prompt", "response_format", lora=lora)
        rid = f"cmpl-{uuid.uuid4().hex}"
        with self.common.admit(len(prompts) * params.n) as admission:
            outputs = await self.common.start(req, rid, checked, self.common.deadline(arrival, req), admission)
        if req.stream:
            return sse(self._stream_completion(rid, req, prompts, params, outputs), outputs)
        finals = await self.common.collect(request, outputs)
        choices = []
        for (pi, k), out in sorted(finals.items()):
            c = out.outputs[0]
            prefix = prompts[pi].text if req.echo else ""
            choices.append({"index": pi * params.n + k, "text": prefix + c.text, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                            "logprobs": completion_logprobs(self.model.tokenizer, c.logprobs, len(prefix))
                            if c.logprobs is not None else None})
        return JSONResponse({"id": rid, "object": "text_completion", "created": now(), "model": self.common.answering(req),
                             "choices": choices, "usage": self.common.usage(prompts, finals)})

    def _stream_completion(self, rid: str, req: CompletionRequest, prompts: list[Prompt], params: SamplingParams,
                           outputs) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}   # characters sent per choice (logprobs' text_offset)

        def choices(pi: int, c) -> list[dict]:
            idx = pi * params.n + c.index
            text = c.delta_text
            if req.echo and idx not in offsets:
                text = prompts[pi].text + text
            lp = None
            if c.delta_logprobs is not None:
                lp = completion_logprobs(self.model.tokenizer, c.delta_logprobs, offsets.get(idx, 0))
            offsets[idx] = offsets.get(idx, 0) + len(text)
            if not (text or c.finished or (lp and lp["tokens"])):
                return []
            return [{"index": idx, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason}]

        return self.common.stream(rid, "text_completion", req, prompts, outputs, choices)

    def _encode(self, text: str, param: str) -> Prompt:
        if not text.strip():
            raise ApiError(400, f"{param} must not be empty", param="prompt")
        return Prompt(text, self.model.tokenizer.encode(text))

    def _completion_prompts(self, prompt) -> list[Prompt]:
        """A string, a list of strings, a list of token ids, or a list of token-id lists. Tokenises:
        called on a worker thread."""
        if isinstance(prompt, str):
            return [self._encode(prompt, "prompt")]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                out.append(self._encode(p, f"prompt[{i}]"))
            elif not p:
                raise ApiError(400, f"prompt[{i}] must not be empty", param="prompt")
            else:
                vocab = self.client.info.vocab_size
                if min(p) < 0 or max(p) >= vocab:
                    raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
                out.append(Prompt(self.model.tokenizer.decode(p, skip_special_tokens=False), list(p)))
        return out
