"""The HTTP server's own settings (the ``serve`` flags that are not EngineArgs): access
control, CORS, request-body limits, logging, and the reply parsers."""

from __future__ import annotations

import os
from dataclasses import dataclass

MiB = 1 << 20
API_KEY_ENV = "TOKENSPEED_API_KEY"


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None  # guards the API routes (Authorization: Bearer <key>)
    metrics_api_key: str | None = None  # guards /metrics too (it is open without one)
    allowed_origins: tuple[str, ...] = ("*",)  # CORS, as vLLM's defaults
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_body_bytes: int = 8 * MiB
    body_timeout_seconds: float = 30.0  # a body not received within this gets 408
    access_log: bool = True  # one line per HTTP request (--disable-log-requests: off)
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral | pythonic
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses the model's calls
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1

    @classmethod
    def from_flags(cls, ns) -> ServerOptions:
        def split(values: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
            if not values:
                return default
            return tuple(v.strip() for value in values for v in value.split(",") if v.strip())

        return cls(
            api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None,
            metrics_api_key=ns.metrics_api_key,
            allowed_origins=split(ns.allowed_origins, ("*",)),
            allowed_methods=split(ns.allowed_methods, ("*",)),
            allowed_headers=split(ns.allowed_headers, ("*",)),
            allow_credentials=ns.allow_credentials,
            max_body_bytes=ns.max_body_bytes,
            body_timeout_seconds=ns.body_timeout,
            access_log=not ns.disable_log_requests,
            tool_call_parser=ns.tool_call_parser,
            enable_auto_tool_choice=ns.enable_auto_tool_choice,
            reasoning_parser=ns.reasoning_parser,
        )
