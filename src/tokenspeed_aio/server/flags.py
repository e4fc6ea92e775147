"""The ``serve`` command's server flags (ServerOptions) and the flags other engines take
that this one refuses with a reason. Imports nothing heavy: ``serve --help`` stays fast."""

from __future__ import annotations

import argparse

from tokenspeed_aio.tokenization.parsers import REASONING_PARSERS, TOOL_PARSERS


class RefuseTrustRemoteCode(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(
            "--trust-remote-code: this engine never runs a checkpoint's custom model code; "
            "it serves the architectures it implements (Llama, Mistral, Qwen2, Qwen3) from "
            "their weights alone, so the flag is not needed for those and cannot help others"
        )


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    add = server.add_argument
    add("--host", default="127.0.0.1", help="address to listen on")
    add("--port", type=int, default=8000, help="port to listen on")
    add(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the API routes (/health and /metrics stay "
        "open); also read from TOKENSPEED_API_KEY",
    )
    add("--metrics-api-key", default=None, help="require this bearer key on /metrics too")
    add("--allowed-origins", nargs="+", default=None, help="CORS origins (default: *)")
    add("--allowed-methods", nargs="+", default=None, help="CORS methods (default: *)")
    add("--allowed-headers", nargs="+", default=None, help="CORS headers (default: *)")
    add("--allow-credentials", action="store_true", help="CORS: allow credentials")
    add("--max-body-bytes", type=int, default=8 * 2**20, help="largest request body accepted")
    add(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request body (then 408)",
    )
    add(
        "--disable-log-requests",
        action="store_true",
        help="no access log line per HTTP request",
    )
    add(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how the model writes tool calls (needed for tool_choice auto, and for "
        "required/named choices in the model's own format)",
    )
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let tool_choice 'auto' return the calls the model writes (needs --tool-call-parser)",
    )
    add(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split <think>...</think> into reasoning_content",
    )
    add(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging verbosity",
    )
    add(
        "--trust-remote-code",
        nargs=0,
        action=RefuseTrustRemoteCode,
        help="refused: custom model code is never run",
    )
