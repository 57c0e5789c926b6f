"""POST /tokenize and /detokenize (vLLM's routes and shapes): what the server would feed the model, without
generating. A prompt is tokenised as /v1/completions tokenises it; chat messages go through the chat endpoint's own
rendering (template, images and audio expanded), so the count is what a chat request would take."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from .protocol import ApiError, DetokenizeRequest, TokenizeRequest, parse
from .serving import ServingCommon
from .serving_chat import ChatServing


class TokenizeServing:
    def __init__(self, common: ServingCommon, chat: ChatServing):
        self.common, self.chat = common, chat

    async def tokenize(self, request: Request) -> JSONResponse:
        req: TokenizeRequest = parse(TokenizeRequest, await self.common.read_json(request))
        self.common.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give either `prompt` or `messages`", param="prompt" if req.prompt is None else
                           "messages")
        tok = self.common.model.tokenizer
        if req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            messages = [m.model_dump(exclude_none=True, by_alias=True) for m in req.messages]
            prompt, _ = await asyncio.to_thread(self.chat.chat_prompt, messages, None, req.chat_template_kwargs)
            ids = prompt.ids
        body = {"count": len(ids), "max_model_len": self.common.client.info.max_model_len, "tokens": ids,
                "token_strs": [tok.decode([i], skip_special_tokens=False) for i in ids] if req.return_token_strs
                else None}
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> JSONResponse:
        req: DetokenizeRequest = parse(DetokenizeRequest, await self.common.read_json(request))
        self.common.check_model(req.model)
        vocab = self.common.client.info.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {vocab}): got {bad[:5]}", param="tokens")
        return JSONResponse({"prompt": self.common.model.tokenizer.decode(req.tokens, skip_special_tokens=False)})
