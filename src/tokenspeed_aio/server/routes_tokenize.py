"""POST /tokenize and /detokenize (vLLM's shapes): a prompt's or a conversation's token
ids as the completion and chat routes would make them, and token ids back to text."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenspeed_aio.protocol.openai import ChatCompletionRequest
from tokenspeed_aio.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenspeed_aio.server.body import json_response, parse_body
from tokenspeed_aio.server.chat_prompt import chat_prompt
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import ApiError
from tokenspeed_aio.server.generation import tokenize


def tokenize_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        req = await parse_body(request, TokenizeRequest)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "prompt: give exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = (await tokenize(ctx.frontend.tokenizer, [req.prompt], special))[0]
        else:
            chat = ChatCompletionRequest(
                messages=req.messages or [],
                add_generation_prompt=req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs,
                tools=req.tools,
            )
            ids, _ = await chat_prompt(ctx, chat, add_special_tokens=bool(req.add_special_tokens))
        strs = [ctx.token_texts(t) for t in ids] if req.return_token_strs else None
        return json_response(TokenizeResponse(len(ids), ctx.frontend.max_model_len, ids, strs))

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        req = await parse_body(request, DetokenizeRequest)
        ctx.check_model(req.model)
        limit = ctx.frontend.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < limit), None)
        if bad is not None:
            raise ApiError(
                400,
                f"tokens: token id {bad} is outside the vocabulary [0, {limit})",
                param="tokens",
            )
        return json_response(DetokenizeResponse(ctx.frontend.tokenizer.decode(req.tokens, False)))

    return router
