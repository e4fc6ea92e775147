"""SGLang's native routes: POST /generate (text or input_ids, one or a batch, streamed
or not) and POST /abort_request. SGLang's control routes (pause, weight updates, memory
release) are routes_control.py's."""

from __future__ import annotations

import time
import uuid

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.errors import InvalidRequestError, RequestConflictError
from tokenspeed_aio.protocol.sglang import (
    NOT_IMPLEMENTED,
    AbortRequest,
    AbortResult,
    GenerateFinishReason,
    GenerateRequest,
    GenerateResult,
    GenerateSamplingParams,
    MetaInfo,
)
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.server.body import json_response, parse_body
from tokenspeed_aio.server.bootstrap import assign_bootstrap
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import ApiError
from tokenspeed_aio.server.generation import Job, make_jobs, tokenize
from tokenspeed_aio.server.openai_common import (
    collect,
    parse_logit_bias,
    renamed,
    sse_stream,
    stream_response,
)
from tokenspeed_aio.server.streaming import cancel_on_disconnect

SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
# SamplingParams' names for SGLang's, so a validation error names the field sent.
RENAMED = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
}


def refuse_not_implemented(obj: msgspec.Struct, where: str = "") -> None:
    """ApiError(400) naming the first documented-but-not-implemented field ``obj`` sets
    away from its default (``where``: the path of ``obj`` in the request)."""
    for field in msgspec.structs.fields(obj):
        why = NOT_IMPLEMENTED[type(obj)].get(field.name)
        if why is not None and getattr(obj, field.name) != field.default:
            name = f"{where}{field.name}"
            raise ApiError(400, f"{name}: {why}", param=name)


def to_sampling_params(
    sp: GenerateSamplingParams, req: GenerateRequest, where: str
) -> SamplingParams:
    """``where``: the params' path in the request (``sampling_params.`` or, in a list of
    them, ``sampling_params[i].``)."""
    refuse_not_implemented(sp, where)
    stop = [sp.stop] if isinstance(sp.stop, str) else sp.stop
    bias = parse_logit_bias(sp.logit_bias, f"{where}logit_bias") if sp.logit_bias else None
    try:
        return SamplingParams(
            n=sp.n,
            max_tokens=sp.max_new_tokens,
            min_tokens=sp.min_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty,
            repetition_penalty=sp.repetition_penalty,
            stop=stop or [],
            stop_token_ids=sp.stop_token_ids or [],
            ignore_eos=sp.ignore_eos,
            skip_special_tokens=sp.skip_special_tokens,
            include_stop_str_in_output=sp.no_stop_trim,
            seed=sp.sampling_seed,
            logprobs=req.top_logprobs_num if req.return_logprob else None,
            json_schema=sp.json_schema,
            regex=sp.regex,
            ebnf=sp.ebnf,
            structural_tag=sp.structural_tag,
            logit_bias=bias,
        )
    except InvalidRequestError as exc:
        names = {p: f"{where}{RENAMED.get(p, p)}" for p in SAMPLING_FIELDS}
        names["logprobs"] = "top_logprobs_num"  # a top-level field in SGLang
        raise renamed(exc, names) from None


async def resolve(ctx: ServerContext, req: GenerateRequest) -> tuple[list[list[int]], bool]:
    """(token ids per prompt, whether the request is a batch)."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "text: give exactly one of text or input_ids", param="text")
    if isinstance(req.text, str):
        return await tokenize(ctx.frontend.tokenizer, [req.text], True), False
    if req.text is not None:
        if not req.text:
            raise ApiError(400, "text: the list of prompts is empty", param="text")
        return await tokenize(ctx.frontend.tokenizer, req.text, True), True
    ids = req.input_ids or []
    if ids and all(isinstance(t, int) for t in ids):
        return [[t for t in ids if isinstance(t, int)]], False
    if ids and all(isinstance(t, list) for t in ids):
        return [t for t in ids if isinstance(t, list)], True
    raise ApiError(400, "input_ids: a list of token ids or a list of such lists", param="input_ids")


def plan(
    ctx: ServerContext, req: GenerateRequest, prompts: list[list[int]]
) -> tuple[str, list[Job]]:
    """The fan-out's id and its jobs: each prompt with its own sampling params and rid."""
    count = len(prompts)
    sps = req.sampling_params or GenerateSamplingParams()
    listed = isinstance(sps, list)
    sps = sps if listed else [sps] * count
    rids = req.rid if isinstance(req.rid, list) else None
    if req.rid == "" or (rids is not None and "" in rids):
        raise ApiError(400, "rid: a request id must be a non-empty string", param="rid")
    if len(sps) != count or (rids is not None and len(rids) != count):
        raise ApiError(400, f"sampling_params and rid: one per prompt ({count})", param="rid")
    request_id = req.rid if isinstance(req.rid, str) else uuid.uuid4().hex
    jobs: list[Job] = []
    for p, (ids, sp) in enumerate(zip(prompts, sps)):
        rid = rids[p] if rids else request_id if count == 1 else f"{request_id}-{p}"
        where = f"sampling_params[{p}]." if listed else "sampling_params."
        prompt_jobs = make_jobs(ctx.frontend, rid, [ids], to_sampling_params(sp, req, where))
        if len(prompt_jobs) == 1:
            prompt_jobs[0].rid = rid  # SGLang: the engine request is the rid given
        for job in prompt_jobs:
            job.index, job.prompt_index = len(jobs), p
            jobs.append(job)
    seen: set[str] = set()
    for job in jobs:
        if job.rid in seen or ctx.registry.running(job.rid) or ctx.frontend.in_use(job.rid):
            raise RequestConflictError(f"rid: request {job.rid!r} is already running", param="rid")
        seen.add(job.rid)
    return request_id, jobs


def finish_reason(out: RequestOutput) -> GenerateFinishReason | None:
    if not out.finished:
        return None
    if out.finish_reason == "length":
        return GenerateFinishReason("length", length=len(out.token_ids))
    if out.finish_reason == "stop":
        return GenerateFinishReason("stop", matched=out.stop_reason)
    return GenerateFinishReason(out.finish_reason or "abort")


def result(job: Job, out: RequestOutput, arrival: float, batch: bool) -> GenerateResult:
    token_lps = top_lps = None
    if out.logprobs is not None:
        token_lps = [(lp.logprob, t, None) for t, lp in zip(out.token_ids, out.logprobs)]
        top_lps = [[(v, alt, None) for alt, v in lp.top] for lp in out.logprobs]
    meta = MetaInfo(
        id=job.rid,
        prompt_tokens=len(job.prompt_ids),
        completion_tokens=len(out.token_ids),
        cached_tokens=out.num_cached_tokens,
        finish_reason=finish_reason(out),
        e2e_latency=time.monotonic() - arrival,
        output_token_logprobs=token_lps,
        output_top_logprobs=top_lps,
        weight_version=out.weight_version or None,
        input_token_logprobs=None if token_lps is None else [],
    )
    return GenerateResult(out.text, out.token_ids, meta, job.index if batch else None)


def sglang_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(request, GenerateRequest)
        refuse_not_implemented(req)
        prompts, batch = await resolve(ctx, req)
        request_id, jobs = plan(ctx, req, prompts)
        assign_bootstrap(ctx.frontend, jobs, req, len(prompts))
        fanout = ctx.fanout(request_id, jobs)
        if req.stream:

            def render(job: Job, out: RequestOutput) -> list[GenerateResult]:
                return [result(job, out, arrival, batch)]

            events = sse_stream(fanout, render, None, request_id, cumulative=True)
            return stream_response(fanout, events)
        finals = await cancel_on_disconnect(request.receive, collect(fanout))
        results = [result(job, finals[job.index], arrival, batch) for job in jobs]
        return json_response(results if batch else results[0])

    @router.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req = await parse_body(request, AbortRequest)
        if req.abort_all:
            if not request.scope["state"].get("admin", True):
                raise ApiError(
                    403,
                    "abort_all: aborting every request needs the admin key "
                    "(Authorization: Bearer <--admin-api-key>)",
                    param="abort_all",
                    code="admin_key_required",
                )
            return json_response(AbortResult(ctx.registry.abort_all()))
        if not req.rid:
            raise ApiError(400, "rid: required (or abort_all: true)", param="rid")
        return json_response(AbortResult(ctx.registry.abort(req.rid)))

    return router
