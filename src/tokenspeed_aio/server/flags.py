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
    add(
        "--admin-api-key",
        default=None,
        help="require this bearer key on abort-all and the control routes (pause, weight "
        "updates, memory release, cache flush, profiling)",
    )
    add(
        "--allowed-origins",
        nargs="+",
        default=None,
        help="origins besides the server's own that browsers may call it from (CORS, "
        "state-changing routes); '*' for any (default: none)",
    )
    add(
        "--allowed-hosts",
        nargs="+",
        default=None,
        help="Host header names accepted besides the bound address's; '*' for any "
        "(default: on a loopback address only loopback names)",
    )
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
        "--max-header-bytes",
        type=int,
        default=64 * 1024,
        help="largest request head (request line and headers) accepted (431 beyond)",
    )
    add("--max-header-count", type=int, default=100, help="most headers a request may carry")
    add("--max-url-bytes", type=int, default=16 * 1024, help="longest URL accepted (414 beyond)")
    add(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client may take to send a request head (then 408 and closed)",
    )
    add(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    add(
        "--max-connections",
        type=int,
        default=4096,
        help="most open client connections (one more is answered 503 and closed)",
    )
    add(
        "--max-stream-backlog",
        type=int,
        default=512,
        help="tokens per choice a streaming client may fall behind before its request is "
        "aborted with an error event",
    )
    add(
        "--stream-send-buffer",
        type=int,
        default=64 * 1024,
        help="bytes of a streaming response's socket send buffer, so that a client which "
        "stops reading is noticed (0: the kernel's autotuned buffer, up to megabytes)",
    )
    add(
        "--max-sequences-per-request",
        type=int,
        default=1024,
        help="most sequences (prompts x n) one request may create (400 beyond)",
    )
    add(
        "--max-waiting-sequences",
        type=int,
        default=16384,
        help="most sequences admitted and not yet finished (429 with Retry-After beyond)",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM/SIGINT (then aborted)",
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
