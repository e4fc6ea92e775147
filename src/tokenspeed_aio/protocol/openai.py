"""The OpenAI-compatible HTTP API's messages (completions, chat completions, models,
errors) as msgspec Structs.

The server decodes requests with these types (msgspec validates types while it
parses, and its errors name the field) and encodes responses with them; the
client library decodes the same types, so both sides agree by construction.
Request fields left out keep a ``None`` default meaning "the engine's default" (the
checkpoint's generation_config.json, else the API's). A request field this server does
not know is refused with a 400 naming it (``forbid_unknown_fields``), never ignored; the
few OpenAI fields that change nothing here (``user``) are accepted by name. Messages stay
lenient: clients send back whole response messages (``refusal``, ``annotations``).
This module imports nothing from the engine: the client uses it as is.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from tokenspeed_aio.protocol.tools import DeltaToolCall, Tool, ToolCall, ToolChoice


# -- requests -------------------------------------------------------------------
class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False  # a last chunk with usage and no choices


class StructuredOutputs(
    msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """vLLM's ``structured_outputs`` (at most one field set); the same grammars as the
    ``guided_*`` fields and ``response_format``."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None


class SamplingFields(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
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
    # SGLang's extensions, which its Model Gateway sends on every request (at their
    # defaults): no_stop_trim is include_stop_str_in_output's SGLang name; hidden states
    # are not returned by this server (true is refused).
    no_stop_trim: bool | None = None
    return_hidden_states: bool = False
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    prompt_logprobs: int | None = None  # top-N alternatives per prompt token (vLLM)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens (vLLM)
    # Structured output: OpenAI's response_format ({"type": "json_object"}, {"type":
    # "json_schema", "json_schema": {"schema": ...}}; SGLang's "regex", "ebnf", vLLM's
    # "choice", "structural_tag"), the extra fields json_schema (a schema object or its
    # JSON text), regex, ebnf, vLLM's guided_* fields, or its structured_outputs.
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = None  # accepted and ignored: it names the end user for OpenAI's logs
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
    reasoning_content: str | None = None  # an earlier turn's reasoning, passed back


class ChatCompletionRequest(SamplingFields, kw_only=True, omit_defaults=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True  # false: at most one call per reply
    # SGLang's: continue the last (assistant) message instead of starting a new one;
    # split <think> into reasoning_content when a reasoning parser is on (false: leave it
    # in the content); stream the reasoning as deltas (false is refused).
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True


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


class PromptLogprob(msgspec.Struct, omit_defaults=True):
    logprob: float
    decoded_token: str
    rank: int | None = None


# vLLM's prompt_logprobs: per prompt token {token id: entry} (the token and its top-N
# alternatives); None for the first token, which has no logprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    prompt_logprobs: PromptLogprobs | None = None


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
    tool_calls: list[ToolCall] = []
    reasoning_content: str | None = None  # with --reasoning-parser: the thinking part


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
    prompt_logprobs: PromptLogprobs | None = None  # vLLM puts chat's at the top level


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None  # only in a choice's first chunk
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
