"""The HTTP server's own settings (the ``serve`` flags that are not EngineArgs): access
control, CORS, request and connection limits, admission, the drain, logging, and the
reply parsers."""

from __future__ import annotations

import os
from dataclasses import dataclass

MiB = 1 << 20
API_KEY_ENV = "TOKENSPEED_API_KEY"


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None  # guards the API routes (Authorization: Bearer <key>)
    metrics_api_key: str | None = None  # guards /metrics too (it is open without one)
    admin_api_key: str | None = None  # guards abort-all and the control routes
    # Origins other than the server's own that may call it (CORS and state-changing
    # routes); none by default: a web page elsewhere cannot drive the server.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Host header names accepted besides the bound address's (a loopback server accepts
    # only loopback names: DNS rebinding); "*" accepts any.
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 8 * MiB
    body_timeout_seconds: float = 30.0  # a body not received within this gets 408
    max_header_bytes: int = 64 * 1024  # request line and headers (431)
    max_header_count: int = 100  # (431)
    max_url_bytes: int = 16 * 1024  # (414)
    header_timeout_seconds: float = 10.0  # a request head not received within this: 408
    keep_alive_seconds: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 4096  # open connections; one more is answered 503
    max_stream_backlog: int = 512  # undelivered tokens per choice before a stream is cut
    stream_send_buffer: int = 64 * 1024  # a streaming response's SO_SNDBUF (0: the kernel's)
    max_sequences_per_request: int = 1024  # prompts x n (400 beyond)
    max_waiting_sequences: int = 16384  # sequences admitted and not finished (429 beyond)
    shutdown_timeout_seconds: float = 30.0  # running requests' time to finish at a stop
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
            admin_api_key=ns.admin_api_key,
            allowed_origins=split(ns.allowed_origins, ()),
            allowed_methods=split(ns.allowed_methods, ("*",)),
            allowed_headers=split(ns.allowed_headers, ("*",)),
            allow_credentials=ns.allow_credentials,
            allowed_hosts=split(ns.allowed_hosts, ()),
            max_body_bytes=ns.max_body_bytes,
            body_timeout_seconds=ns.body_timeout,
            max_header_bytes=ns.max_header_bytes,
            max_header_count=ns.max_header_count,
            max_url_bytes=ns.max_url_bytes,
            header_timeout_seconds=ns.header_timeout,
            keep_alive_seconds=ns.keep_alive_timeout,
            max_connections=ns.max_connections,
            max_stream_backlog=ns.max_stream_backlog,
            stream_send_buffer=ns.stream_send_buffer,
            max_sequences_per_request=ns.max_sequences_per_request,
            max_waiting_sequences=ns.max_waiting_sequences,
            shutdown_timeout_seconds=ns.shutdown_timeout,
            access_log=not ns.disable_log_requests,
            tool_call_parser=ns.tool_call_parser,
            enable_auto_tool_choice=ns.enable_auto_tool_choice,
            reasoning_parser=ns.reasoning_parser,
        )
