"""POST /v1/chat/completions: messages rendered with the model's chat template, n
choices, logprobs in chat's format, tool calls and reasoning split out of the reply
(chat_reply.py), streaming with a role chunk first."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from starlette.responses import Response

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
)
from tokenspeed_aio.protocol.tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from tokenspeed_aio.server.body import parse_body
from tokenspeed_aio.server.bootstrap import assign_bootstrap
from tokenspeed_aio.server.chat_prompt import chat_prompt
from tokenspeed_aio.server.chat_reply import ReplyParser, ReplyParts, ReplyStream
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import ApiError
from tokenspeed_aio.server.generation import Job, make_jobs
from tokenspeed_aio.server.logprobs import chat_logprobs, prompt_logprobs
from tokenspeed_aio.server.openai_common import (
    collect,
    respond,
    sampling_params,
    sse_stream,
    stream_response,
    truncate_prompt,
    usage,
)
from tokenspeed_aio.server.streaming import cancel_on_disconnect
from tokenspeed_aio.server.tool_choice import plan_tools
from tokenspeed_aio.tokenization.parsers import ParsedCall


def _finish_reason(out: RequestOutput, calls: bool) -> str | None:
    """OpenAI's "tool_calls" when a reply that stopped by itself made calls."""
    if calls and out.finish_reason == "stop":
        return "tool_calls"
    return out.finish_reason


def _tool_calls(calls: list[ParsedCall]) -> list[ToolCall]:
    return [ToolCall(c.id, FunctionCall(c.name, c.arguments)) for c in calls]


@dataclass(slots=True)
class _ChoiceStream:
    reply: ReplyStream | None
    started: bool = False  # the role chunk went out
    calls: int = 0  # tool calls sent (the next one's index)


class ChatView:
    """Renders one chat request's outputs as a ChatCompletion or streamed chunks."""

    def __init__(
        self,
        ctx: ServerContext,
        req: ChatCompletionRequest,
        request_id: str,
        prompt: list[int],
        reply: ReplyParser,
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.created = int(time.time())
        self.prompt = prompt
        self.reply = reply
        self.streams: dict[int, _ChoiceStream] = {}
        self.finals: dict[int, RequestOutput] = {}

    def _logprobs(self, out: RequestOutput) -> ChatLogprobs | None:
        """The logprobs of the output's tokens (of a stream's delta output: the new ones)."""
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.ctx.token_texts, out.token_ids, out.logprobs or [])

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            self.request_id, self.created, self.ctx.served_model_name, [choice]
        )

    def _message(self, out: RequestOutput) -> tuple[AssistantMessage, bool]:
        if not self.reply.active:
            return AssistantMessage(out.text), False
        parts = self.reply.whole(out.text)
        message = AssistantMessage(parts.content, tool_calls=_tool_calls(parts.calls))
        message.reasoning_content = parts.reasoning
        return message, bool(parts.calls)

    def completion(self, jobs: list[Job], finals: dict[int, RequestOutput]) -> ChatCompletion:
        choices = []
        for job in jobs:
            out = finals[job.index]
            message, calls = self._message(out)
            choices.append(
                ChatChoice(
                    job.index,
                    message,
                    self._logprobs(out),
                    _finish_reason(out, calls),
                    out.stop_reason,
                )
            )
        first = finals[jobs[0].index]
        return ChatCompletion(
            self.request_id,
            self.created,
            self.ctx.served_model_name,
            choices,
            usage=usage([self.prompt], self.req.n, finals),
            prompt_logprobs=prompt_logprobs(self.ctx.token_texts, self.prompt, first)
            if self.req.prompt_logprobs is not None
            else None,
        )

    def _delta(self, st: _ChoiceStream, parts: ReplyParts) -> ChatDelta:
        calls = None
        if parts.calls:
            calls = []
            for call in parts.calls:
                function = DeltaFunctionCall(call.name, call.arguments)
                calls.append(DeltaToolCall(st.calls, call.id, "function", function))
                st.calls += 1
        return ChatDelta(content=parts.content, reasoning_content=parts.reasoning, tool_calls=calls)

    def chunks(self, job: Job, out: RequestOutput) -> list[ChatCompletionChunk]:
        """The chunks of one delta output (a stream's)."""
        st = self.streams.get(job.index)
        if st is None:
            reply = self.reply.stream() if self.reply.active else None
            st = self.streams[job.index] = _ChoiceStream(reply)
        result = []
        if not st.started:
            st.started = True
            role = ChatDelta(role="assistant", content="")
            result.append(self._chunk(ChatChunkChoice(job.index, role)))
        lp = self._logprobs(out)
        if st.reply is None:
            delta = ChatDelta(content=out.delta_text) if out.delta_text else ChatDelta()
        else:
            parts = st.reply.feed(out.delta_text) if out.delta_text else ReplyParts(None, None, [])
            if out.finished:
                end = st.reply.finish()
                parts = ReplyParts(
                    _join(parts.reasoning, end.reasoning),
                    _join(parts.content, end.content),
                    parts.calls + end.calls,
                )
            delta = self._delta(st, parts)
        if out.finished:
            self.finals[job.index] = out
        elif delta == ChatDelta() and not (lp and lp.content):
            return result
        reason = _finish_reason(out, st.calls > 0) if out.finished else None
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


def _join(a: str | None, b: str | None) -> str | None:
    return (a or "") + (b or "") or None


def chat_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
        if not req.stream_reasoning:
            raise ApiError(
                400,
                "stream_reasoning: false is not supported (reasoning streams as deltas)",
                param="stream_reasoning",
            )
        tools = plan_tools(ctx, req)
        prompt, prompt_text = await chat_prompt(ctx, req)
        prompt = truncate_prompt(prompt, req.truncate_prompt_tokens)
        names = {"logprobs": "top_logprobs"}
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
            names["max_tokens"] = "max_completion_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=logprobs,
            names=names,
            defaults=ctx.generation_defaults,
            grammar=tools.grammar,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = make_jobs(ctx.frontend, request_id, [prompt], params)
        assign_bootstrap(ctx.frontend, jobs, req, 1)
        reasoning = ctx.reasoning_parser if req.separate_reasoning else None
        reply = ReplyParser(tools, reasoning, prompt_text, params.has_grammar)
        view = ChatView(ctx, req, request_id, prompt, reply)
        fanout = ctx.fanout(request_id, jobs)
        if req.stream:
            events = sse_stream(fanout, view.chunks, view.last_chunks, request_id)
            return stream_response(fanout, events)
        finals = await cancel_on_disconnect(request.receive, collect(fanout))
        return await respond(lambda: view.completion(jobs, finals), finals, logprobs)

    return router
