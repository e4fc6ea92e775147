"""SGLang's native API (``POST /generate``, ``POST /abort_request``) as msgspec Structs,
shared by the server and the client like ``protocol``.

Field names and defaults follow SGLang's ``GenerateReqInput`` and its sampling
params, so RL frameworks written against SGLang work unchanged. A field SGLang does not
document is refused with a 400 naming it (``forbid_unknown_fields``); the documented
fields this server does not implement are accepted at their defaults (gateways and
SGLang clients send some of them) and refused by name otherwise (``NOT_IMPLEMENTED``).
"""

from __future__ import annotations

from typing import Any

import msgspec

Json = Any  # a field accepted only at its default: what it would hold is never read


class GenerateSamplingParams(
    msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
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
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    # documented, not implemented (NOT_IMPLEMENTED)
    stop_regex: str | list[str] | None = None
    spaces_between_special_tokens: bool = True
    custom_params: Json = None
    thinking_budget: int | None = None
    stream_interval: int | None = None


class GenerateRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """``text`` or ``input_ids``; a list of either is a batch (one result per prompt×n)."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Prefill/decode disaggregation (the gateway's fan-out): scalars, or one per prompt.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    # Accepted and changing nothing: the model a gateway routed to (one per server), and
    # log_metrics (the metrics are always recorded).
    model: str | None = None
    log_metrics: bool = True
    # documented, not implemented (NOT_IMPLEMENTED)
    logprob_start_len: int = -1
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    return_hidden_states: bool = False
    input_embeds: Json = None
    image_data: Json = None
    video_data: Json = None
    audio_data: Json = None
    modalities: list[str] | None = None
    session_params: Json = None
    lora_path: str | list[str | None] | None = None
    lora_id: str | list[str | None] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    bootstrap_pair_key: str | list[str] | None = None
    data_parallel_rank: int | None = None
    priority: int | None = None
    background: bool = False
    conversation_id: str | None = None
    extra_key: str | list[str] | None = None
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    return_bytes: bool = False
    return_entropy: bool = False


# The documented fields refused away from their defaults, and why.
NOT_IMPLEMENTED: dict[type[msgspec.Struct], dict[str, str]] = {
    GenerateRequest: {
        "logprob_start_len": "prompt logprobs are not computed on /generate "
        "(leave it at -1; /v1/completions takes prompt_logprobs)",
        "token_ids_logprob": "logprobs of chosen token ids are not returned",
        "return_text_in_logprobs": "logprobs carry token ids only (decode them with /detokenize)",
        "return_hidden_states": "this server does not return hidden states",
        "input_embeds": "prompts are text or token ids, not embeddings",
        "image_data": "this server serves text models only",
        "video_data": "this server serves text models only",
        "audio_data": "this server serves text models only",
        "modalities": "this server serves text models only",
        "session_params": "sessions are not supported",
        "lora_path": "LoRA adapters are not supported",
        "lora_id": "LoRA adapters are not supported",
        "custom_logit_processor": "custom logit processors are not run",
        "bootstrap_pair_key": "rooms are paired by bootstrap_room alone",
        "data_parallel_rank": "the server places requests on its data-parallel replicas itself",
        "priority": "requests are scheduled in arrival order (no priorities)",
        "background": "requests run in the foreground (no background responses)",
        "conversation_id": "conversations are not tracked",
        "extra_key": "the prefix cache is not partitioned by key",
        "no_logs": "requests are logged or not for the whole server (--disable-log-requests)",
        "custom_labels": "metrics carry no per-request labels",
        "return_bytes": "text is returned as a string",
        "return_entropy": "entropies are not returned",
    },
    GenerateSamplingParams: {
        "stop_regex": "stop strings are literal (stop), not regular expressions",
        "spaces_between_special_tokens": "special tokens are decoded without added spaces",
        "custom_params": "custom logit processors are not run",
        "thinking_budget": "a thinking budget is not enforced",
        "stream_interval": "every new token is streamed",
    },
}


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
    # with return_logprob: the prompt's (logprob, token id, None) -- none computed here;
    # the gateway prepends a prefill engine's to a decode engine's
    input_token_logprobs: list[tuple[float | None, int, None]] | None = None


class GenerateResult(msgspec.Struct, omit_defaults=True):
    """One prompt's result; streamed chunks carry the text and ids so far."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None  # the choice's position in a batch
