"""What the completions and chat routes share: request fields to SamplingParams,
usage, collecting the final outputs, building a large response off the loop, and
the SSE framing of a response stream (with an error event if the engine fails
after the headers went out)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec
from starlette.responses import Response

from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.errors import EngineError, InvalidRequestError
from tokenspeed_aio.protocol.openai import PromptTokensDetails, SamplingFields, Usage
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.server.body import json_response
from tokenspeed_aio.server.errors import ApiError, error_payload, payload_for
from tokenspeed_aio.server.generation import Fanout, Job
from tokenspeed_aio.server.streaming import DONE, EventStream, sse_event
from tokenspeed_aio.server.structured import structured_output

logger = logging.getLogger(__name__)

THREAD_RENDER_ENTRIES = 4096  # logprob entries past which a response is built on a thread

# Request fields copied to SamplingParams when given (same names on both sides).
PASSTHROUGH = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output",
)  # fmt: skip


def renamed(exc: InvalidRequestError, names: dict[str, str]) -> InvalidRequestError:
    """The error with SamplingParams' field name replaced by the one the client sent."""
    if exc.param not in names:
        return exc
    name = names[exc.param]
    return InvalidRequestError(exc.message.replace(f"{exc.param}:", f"{name}:", 1), param=name)


def sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    names: dict[str, str] | None = None,
    defaults: dict[str, Any] | None = None,
    grammar: dict[str, Any] | None = None,
) -> SamplingParams:
    """SamplingParams from an OpenAI request (validated: InvalidRequestError names the
    field and its limit, as ``names`` maps SamplingParams' fields to the request's).
    ``defaults`` (the checkpoint's generation_config.json) fill the fields the request
    left unset; ``grammar`` (a tool choice's constraint) replaces the request's own."""
    fields: dict[str, Any] = dict(defaults or {})
    fields.pop("max_tokens", None)
    if max_tokens is None and defaults and "max_tokens" in defaults:
        max_tokens = defaults["max_tokens"]
    fields.update(
        {name: value for name in PASSTHROUGH if (value := getattr(req, name)) is not None}
    )
    if req.return_hidden_states:
        raise ApiError(
            400,
            "return_hidden_states: this server does not return hidden states",
            param="return_hidden_states",
        )
    if req.no_stop_trim is not None and req.include_stop_str_in_output is None:
        fields["include_stop_str_in_output"] = req.no_stop_trim
    fields.update(grammar if grammar is not None else structured_output(req))
    if req.stop is not None:
        fields["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if req.logit_bias:
        fields["logit_bias"] = parse_logit_bias(req.logit_bias, "logit_bias")
    if req.prompt_logprobs is not None:
        prompt_logprobs = req.prompt_logprobs
    try:
        return SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **fields
        )
    except InvalidRequestError as exc:
        raise renamed(exc, names or {}) from None


def parse_logit_bias(bias: dict[str, float], param: str) -> dict[int, float]:
    """OpenAI's {"token id": bias} with the ids as JSON object keys (strings); ``param``
    names the field in errors."""
    result = {}
    for key, value in bias.items():
        try:
            result[int(key)] = float(value)
        except ValueError:
            raise ApiError(400, f"{param}: keys are token ids, got {key!r}", param=param) from None
    return result


def truncate_prompt(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: only the prompt's last ``keep`` tokens."""
    if keep is None:
        return ids
    if keep < 1:
        raise ApiError(
            400, f"truncate_prompt_tokens: must be >= 1, got {keep}", param="truncate_prompt_tokens"
        )
    return ids[-keep:]


def usage(prompts: list[list[int]], n: int, finals: dict[int, RequestOutput]) -> Usage:
    """Each prompt counts once whatever n is (as OpenAI bills); its cached tokens are
    the fewest any of its choices found cached."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(out.num_tokens for out in finals.values())
    cached = 0
    for p in range(len(prompts)):
        outs = [finals[i] for i in range(p * n, (p + 1) * n) if i in finals]
        cached += min((o.num_cached_tokens for o in outs), default=0)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


async def respond(
    build: Callable[[], Any], finals: dict[int, RequestOutput], top: int | None
) -> Response:
    """The JSON response ``build()`` makes. With many logprob entries (``top``
    alternatives per token) building it is many milliseconds of Python: then it is
    built and encoded on a thread, so the loop keeps streaming to other clients."""
    tokens = sum(len(o.token_ids) + len(o.prompt_logprobs or ()) for o in finals.values())
    if top is None or tokens * (top + 1) <= THREAD_RENDER_ENTRIES:
        return json_response(build())
    body = await asyncio.to_thread(lambda: msgspec.json.encode(build()))
    return Response(body, media_type="application/json")


async def collect(fanout: Fanout) -> dict[int, RequestOutput]:
    """Each choice's final output, by choice index."""
    finals: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(fanout.outputs()) as outputs:
        async for job, out in outputs:
            if out.finished:
                finals[job.index] = out
    return finals


def stream_response(fanout: Fanout, events: AsyncGenerator[bytes, None]) -> EventStream:
    """The SSE response of ``fanout``'s ``events``: the fanout is registered first, so a
    taken request id is refused with a 409 before any header goes out, and the response
    releases it when done, also where its events never started."""
    fanout.register()
    return EventStream(events, on_close=fanout.release)


async def sse_stream(
    fanout: Fanout,
    render: Callable[[Job, RequestOutput], list[Any]],
    last: Callable[[], list[Any]] | None,
    request_id: str,
    cumulative: bool = False,
) -> AsyncGenerator[bytes, None]:
    """Frame a response stream as SSE: ``render`` turns each output into chunks (delta
    outputs, rendered as they arrive: ``Fanout.events``; ``cumulative``: the newest
    cumulative output when the client reads), ``last`` (if any) gives the closing
    chunks (usage); then ``data: [DONE]``. A failure after the headers went out becomes
    an error event (the traceback stays in the log)."""

    def encode(job: Job, out: RequestOutput) -> bytes:
        return b"".join(sse_event(chunk) for chunk in render(job, out))

    source = _cumulative_events(fanout, encode) if cumulative else fanout.events(encode)
    try:
        async with contextlib.aclosing(source):  # closing aborts the engine requests
            async for data in source:
                yield data
        for chunk in last() if last else ():
            yield sse_event(chunk)
    except (ApiError, EngineError) as exc:
        yield sse_event(payload_for(exc)[1])
    except Exception:
        logger.exception("stream %s failed", request_id)
        message = f"internal server error (request id {request_id}); see the server log"
        yield sse_event(error_payload(500, message))
    yield DONE


async def _cumulative_events(
    fanout: Fanout, encode: Callable[[Job, RequestOutput], bytes]
) -> AsyncGenerator[bytes, None]:
    async with contextlib.aclosing(fanout.outputs()) as outputs:
        async for job, out in outputs:
            yield encode(job, out)
