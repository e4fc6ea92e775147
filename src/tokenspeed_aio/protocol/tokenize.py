"""The utility routes' messages: POST /tokenize and /detokenize (vLLM's shapes), and the
bodies of /version, /server_info and /model_info."""

from __future__ import annotations

from typing import Any

import msgspec

from tokenspeed_aio.protocol.openai import ChatMessage
from tokenspeed_aio.protocol.tools import Tool


class TokenizeRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """``prompt`` (a completion's text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str


class ModelInfo(msgspec.Struct):
    """GET /model_info (SGLang's /get_model_info): what is served, with the fields the SGLang
    Model Gateway reads to discover a worker."""

    model_path: str
    tokenizer_path: str
    served_model_name: str
    served_model_names: list[str]
    max_model_len: int
    vocab_size: int
    weight_version: str
    model_type: str | None = None  # the checkpoint's config.json
    architectures: list[str] | None = None
    is_generation: bool = True
    has_image_understanding: bool = False
    preferred_sampling_params: dict | None = None
