"""SGLang's native API (``POST /generate``, ``POST /abort_request``) as msgspec Structs,
shared by the server and the client like ``protocol``.

Field names and defaults follow SGLang's ``GenerateReqInput`` and its sampling
params, so RL frameworks written against SGLang work unchanged.
"""

from __future__ import annotations

import msgspec


class GenerateSamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_new_tokens: int | None = 128  # None: up to the context length
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    n: int = 1
    sampling_seed: int | None = None
    json_schema: str | None = None  # structured output, as SGLang names it
    regex: str | None = None
    ebnf: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``text`` or ``input_ids``; a list of either is a batch (one result per prompt×n)."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0


class AbortRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    rid: str = ""
    abort_all: bool = False


class AbortResult(msgspec.Struct):
    aborted: list[str]  # the engine request ids that were still running


class GenerateFinishReason(msgspec.Struct, omit_defaults=True):
    """SGLang's shape: ``{"type": "length", "length": 16}``, ``{"type": "stop",
    "matched": 2}`` (a stop token id or string), ``{"type": "abort"}``."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class MetaInfo(msgspec.Struct):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: GenerateFinishReason | None = None  # None while streaming
    e2e_latency: float = 0.0  # seconds from arrival to this output
    # (logprob, token id, None) per generated token, when return_logprob
    output_token_logprobs: list[tuple[float, int, None]] | None = None
    # per generated token: its top_logprobs_num alternatives as (logprob, token id, None)
    output_top_logprobs: list[list[tuple[float, int, None]]] | None = None
    weight_version: str | None = None  # the weights' version that produced this output


class GenerateResult(msgspec.Struct, omit_defaults=True):
    """One prompt's result; streamed chunks carry the text and ids so far."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None  # the choice's position in a batch
