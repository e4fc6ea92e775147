"""POST /v1/completions: a prompt, a batch of prompts, token ids or a batch of
token-id lists; n choices each; echo; logprobs in OpenAI's legacy format."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.protocol.openai import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from tokenspeed_aio.server.body import parse_body
from tokenspeed_aio.server.bootstrap import assign_bootstrap
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import ApiError
from tokenspeed_aio.server.generation import Job, make_jobs, tokenize
from tokenspeed_aio.server.logprobs import completion_logprobs, prompt_logprobs
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

PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of token-id lists"


async def resolve_prompts(
    ctx: ServerContext, prompt: str | list[str | int | list[int]]
) -> tuple[list[list[int]], list[str] | None]:
    """(token ids per prompt, the prompt texts when they came as text)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt: the list of prompts is empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        texts = [p for p in prompt if isinstance(p, str)]
        return await tokenize(ctx.frontend.tokenizer, texts, add_special_tokens=True), texts
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]], None
    if all(isinstance(p, list) for p in prompt):
        return [p for p in prompt if isinstance(p, list)], None
    raise ApiError(400, f"prompt: must be {PROMPT_FORMS}, not a mix", param="prompt")


@dataclass(slots=True)
class _ChoiceStream:
    offset: int = 0  # text_offset of the next token
    started: bool = False


class CompletionView:
    """Renders one request's outputs as a Completion or as streamed chunks."""

    def __init__(
        self,
        ctx: ServerContext,
        req: CompletionRequest,
        request_id: str,
        prompts: list[list[int]],
        texts: list[str] | None,
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.created = int(time.time())
        self.prompts = prompts
        self.echo_texts: list[str] = []
        if req.echo:
            decode = ctx.frontend.tokenizer.decode
            self.echo_texts = texts or [decode(ids, False) for ids in prompts]
        self.streams: dict[int, _ChoiceStream] = {}
        self.finals: dict[int, RequestOutput] = {}

    def _prompt_part(self, job: Job, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        """The echoed prompt text and its logprobs (the first token has none)."""
        if not self.req.echo:
            return "", None
        text = self.echo_texts[job.prompt_index]
        if self.req.logprobs is None:
            return text, None
        lps = out.prompt_logprobs or [None] * len(job.prompt_ids)
        return text, completion_logprobs(self.ctx.token_texts, job.prompt_ids, lps, 0)

    def _generated_logprobs(
        self, out: RequestOutput, offset: int, into: CompletionLogprobs | None
    ) -> CompletionLogprobs | None:
        """The logprobs of the output's tokens (of a stream's delta output: the new ones)."""
        if self.req.logprobs is None:
            return None
        lps = out.logprobs or []
        return completion_logprobs(self.ctx.token_texts, out.token_ids, lps, offset, into)

    def completion(self, jobs: list[Job], finals: dict[int, RequestOutput]) -> Completion:
        choices = []
        for job in jobs:
            out = finals[job.index]
            prefix, lp = self._prompt_part(job, out)
            lp = self._generated_logprobs(out, len(prefix), lp)
            prompt_lps = None
            if self.req.prompt_logprobs is not None:
                prompt_lps = prompt_logprobs(self.ctx.token_texts, job.prompt_ids, out)
            choices.append(
                CompletionChoice(
                    job.index,
                    prefix + out.text,
                    lp,
                    out.finish_reason,
                    out.stop_reason,
                    prompt_lps,
                )
            )
        return Completion(
            self.request_id,
            self.created,
            self.ctx.served_model_name,
            choices,
            usage=usage(self.prompts, self.req.n, finals),
        )

    def chunks(self, job: Job, out: RequestOutput) -> list[Completion]:
        """The chunks of one delta output (a stream's)."""
        st = self.streams.setdefault(job.index, _ChoiceStream())
        text, lp = out.delta_text, None
        if not st.started:
            prefix, lp = self._prompt_part(job, out)
            text, st.offset, st.started = prefix + text, len(prefix), True
        lp = self._generated_logprobs(out, st.offset, lp)
        if lp is not None and lp.tokens:
            st.offset = lp.text_offset[-1] + len(lp.tokens[-1])
        if out.finished:
            self.finals[job.index] = out
        elif not text and not (lp and lp.tokens):
            return []
        choice = CompletionChoice(
            job.index,
            text,
            lp,
            out.finish_reason if out.finished else None,
            out.stop_reason if out.finished else None,
        )
        return [Completion(self.request_id, self.created, self.ctx.served_model_name, [choice])]

    def last_chunks(self) -> list[Completion]:
        options = self.req.stream_options
        if options is None or not options.include_usage:
            return []
        summary = usage(self.prompts, self.req.n, self.finals)
        return [
            Completion(self.request_id, self.created, self.ctx.served_model_name, [], usage=summary)
        ]


def completions_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        ctx.check_model(req.model)
        if req.suffix is not None:
            raise ApiError(400, "suffix: not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(
                400, "best_of: not supported (leave it out, or equal to n)", param="best_of"
            )
        prompts, texts = await resolve_prompts(ctx, req.prompt)
        if req.truncate_prompt_tokens is not None:
            prompts = [truncate_prompt(p, req.truncate_prompt_tokens) for p in prompts]
            texts = None  # echo shows what the model saw
        params = sampling_params(
            req,
            max_tokens=req.max_tokens,
            logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if req.echo else None,
            defaults=ctx.generation_defaults,
        )
        request_id = f"cmpl-{uuid.uuid4().hex}"
        jobs = make_jobs(ctx.frontend, request_id, prompts, params)
        assign_bootstrap(ctx.frontend, jobs, req, len(prompts))
        view = CompletionView(ctx, req, request_id, prompts, texts)
        fanout = ctx.fanout(request_id, jobs)
        if req.stream:
            events = sse_stream(fanout, view.chunks, view.last_chunks, request_id)
            return stream_response(fanout, events)
        finals = await cancel_on_disconnect(request.receive, collect(fanout))
        return await respond(lambda: view.completion(jobs, finals), finals, req.logprobs)

    return router
