"""POST /v1/chat/completions: messages rendered with the model's chat template,
n choices, logprobs in chat's format, streaming with a role chunk first."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenspeed_aio.api.frontend import ASYNC_TOKENIZE_CHARS
from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.protocol.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
)
from tokenspeed_aio.server.body import parse_body
from tokenspeed_aio.server.bootstrap import assign_bootstrap
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import ApiError
from tokenspeed_aio.server.generation import Job, make_jobs, tokenize
from tokenspeed_aio.server.logprobs import chat_logprobs
from tokenspeed_aio.server.openai_common import (
    collect,
    respond,
    sampling_params,
    sse_stream,
    usage,
)
from tokenspeed_aio.server.streaming import EventStream, cancel_on_disconnect

# Template variables the server sets itself (the request's own fields, special tokens).
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "bos_token", "eos_token"})


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text parts joined into a string."""
    result = []
    for i, msg in enumerate(messages):
        content = msg.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    problem = (
                        f"only text parts are supported (got type {part.type!r})"
                        if part.type != "text"
                        else "a text part needs its 'text'"
                    )
                    raise ApiError(
                        400,
                        f"messages[{i}].content[{j}]: {problem}",
                        param=f"messages[{i}].content",
                    )
            content = "\n".join(part.text or "" for part in content)
        entry: dict[str, Any] = {"role": msg.role, "content": content}
        if content is None and not msg.tool_calls:
            entry["content"] = ""
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(msg, key)
            if value is not None:
                entry[key] = value
        result.append(entry)
    return result


async def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> list[int]:
    """The rendered conversation's token ids (the template writes the special tokens
    itself, so none are added, as Hugging Face does for templated text)."""
    if not req.messages:
        raise ApiError(400, "messages: the conversation is empty", param="messages")
    messages = template_messages(req.messages)
    tokenizer = ctx.frontend.tokenizer
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(kwargs.keys() & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ApiError(
            400,
            f"chat_template_kwargs: {', '.join(reserved)} cannot be set here (the server "
            "passes them to the template itself)",
            param="chat_template_kwargs",
        )
    kwargs["add_generation_prompt"] = req.add_generation_prompt
    size = sum(len(str(m.get("content") or "")) for m in messages)
    if size > ASYNC_TOKENIZE_CHARS:  # jinja over a long conversation: off the loop
        text = await asyncio.to_thread(tokenizer.render_chat, messages, **kwargs)
    else:
        text = tokenizer.render_chat(messages, **kwargs)
    return (await tokenize(tokenizer, [text], add_special_tokens=False))[0]


@dataclass(slots=True)
class _ChoiceStream:
    tokens: int = 0  # tokens whose logprobs were streamed
    started: bool = False  # the role chunk went out


class ChatView:
    """Renders one chat request's outputs as a ChatCompletion or streamed chunks."""

    def __init__(
        self, ctx: ServerContext, req: ChatCompletionRequest, request_id: str, prompt: list[int]
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.created = int(time.time())
        self.prompt = prompt
        self.streams: dict[int, _ChoiceStream] = {}
        self.finals: dict[int, RequestOutput] = {}

    def _logprobs(self, out: RequestOutput, start: int) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(
            self.ctx.token_texts, out.token_ids[start:], (out.logprobs or [])[start:]
        )

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            self.request_id, self.created, self.ctx.served_model_name, [choice]
        )

    def completion(self, jobs: list[Job], finals: dict[int, RequestOutput]) -> ChatCompletion:
        choices = [
            ChatChoice(
                job.index,
                AssistantMessage(finals[job.index].text),
                self._logprobs(finals[job.index], 0),
                finals[job.index].finish_reason,
                finals[job.index].stop_reason,
            )
            for job in jobs
        ]
        return ChatCompletion(
            self.request_id,
            self.created,
            self.ctx.served_model_name,
            choices,
            usage=usage([self.prompt], self.req.n, finals),
        )

    def chunks(self, job: Job, out: RequestOutput) -> list[ChatCompletionChunk]:
        st = self.streams.setdefault(job.index, _ChoiceStream())
        result = []
        if not st.started:
            st.started = True
            role = ChatDelta(role="assistant", content="")
            result.append(self._chunk(ChatChunkChoice(job.index, role)))
        lp = self._logprobs(out, st.tokens)
        st.tokens = len(out.token_ids)
        if out.finished:
            self.finals[job.index] = out
        elif not out.delta_text and not (lp and lp.content):
            return result
        delta = ChatDelta(content=out.delta_text) if out.delta_text else ChatDelta()
        reason = out.finish_reason if out.finished else None
        stop = out.stop_reason if out.finished else None
        result.append(self._chunk(ChatChunkChoice(job.index, delta, lp, reason, stop)))
        return result

    def last_chunks(self) -> list[ChatCompletionChunk]:
        options = self.req.stream_options
        if options is None or not options.include_usage:
            return []
        summary = usage([self.prompt], self.req.n, self.finals)
        name = self.ctx.served_model_name
        return [ChatCompletionChunk(self.request_id, self.created, name, [], usage=summary)]


def chat_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        ctx.check_model(req.model)
        if req.tools:
            raise ApiError(400, "tools: tool calling is not supported yet", param="tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
        prompt = await chat_prompt(ctx, req)
        names = {"logprobs": "top_logprobs"}
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
            names["max_tokens"] = "max_completion_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, names=names)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = make_jobs(ctx.frontend, request_id, [prompt], params)
        assign_bootstrap(ctx.frontend, jobs, req, 1)
        view = ChatView(ctx, req, request_id, prompt)
        fanout = ctx.fanout(request_id, jobs)
        if req.stream:
            events = sse_stream(fanout.outputs(), view.chunks, view.last_chunks, request_id)
            return EventStream(events)
        finals = await cancel_on_disconnect(request.receive, collect(fanout))
        return await respond(lambda: view.completion(jobs, finals), finals, logprobs)

    return router
