"""The OpenAI-compatible HTTP API's messages (completions, chat completions, models,
errors) as msgspec Structs.

The server decodes requests with these types (msgspec validates types while it
parses, and its errors name the field) and encodes responses with them; the
client library decodes the same types, so both sides agree by construction.
Request fields left out keep a ``None`` default meaning "the engine's default";
unknown request fields are ignored, as OpenAI's own clients send many.
This module imports nothing from the engine: the client uses it as is.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


# -- requests -------------------------------------------------------------------
class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False  # a last chunk with usage and no choices


class SamplingFields(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Fields completions and chat share (OpenAI's plus vLLM's common extensions)."""

    model: str | None = None  # None: the served model
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None  # refused unless empty
    # Structured output: OpenAI's response_format ({"type": "json_object"} or
    # {"type": "json_schema", "json_schema": {"schema": ...}}), or one of the extra
    # fields json_schema (a schema object or its JSON text), regex, ebnf.
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    ebnf: str | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's clients send it
    # Prefill/decode disaggregation, as the SGLang Model Gateway sends them: the prefill
    # engine's bootstrap server and the room of each prompt (lists: one per prompt of a
    # batch, or per choice of a chat with n > 1).
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None


class CompletionRequest(SamplingFields, kw_only=True, omit_defaults=True):
    """POST /v1/completions. ``prompt``: a string, a list of strings (a batch), a list
    of token ids, or a list of token-id lists (a batch)."""

    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # top-N alternatives per token
    echo: bool = False
    best_of: int | None = None  # refused unless equal to n
    suffix: str | None = None  # refused


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True, omit_defaults=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    tools: list[dict[str, Any]] | None = None  # refused unless empty (no tool-call parser yet)


# -- responses ------------------------------------------------------------------
FinishReason = str  # stop | length | abort (a str, so a client survives a new reason)


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    """OpenAI's legacy format: parallel lists, one entry per token."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None for the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []  # each token's start in the choice's text


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it


class Completion(msgspec.Struct):
    """A completion, or one chunk of a streamed one (same shape, as OpenAI's)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    object: str = "chat.completion"
    usage: Usage | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None  # only in a choice's first chunk
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None  # only in the last chunk, with stream_options.include_usage


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "tokenspeed_aio"
    root: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """Every error the server answers, streamed or not, has this body."""

    error: ErrorDetail
