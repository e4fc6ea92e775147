"""The HTTP server: ``build_app`` puts the OpenAI-compatible and SGLang routes,
/health and /metrics in front of an AsyncEngine; ``serve_http`` runs it with uvicorn
on the caller's (uvloop) event loop.

    build_app(engine, served_model_name="m")   # a FastAPI app
    await serve_http(app, "0.0.0.0", 8000, log_level="info")

Every route sees the same ServerContext; the guard middleware wraps them all
(request id, API key, body size, 500s); errors are OpenAI-style bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from tokenspeed_aio.api.engine import AsyncEngine
from tokenspeed_aio.generation_config import generation_defaults
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import install_error_handlers
from tokenspeed_aio.server.http_protocol import ConnectionLimits, protocol_class
from tokenspeed_aio.server.metrics import ServerMetrics
from tokenspeed_aio.server.middleware import GuardMiddleware
from tokenspeed_aio.server.openapi import install_openapi
from tokenspeed_aio.server.options import ServerOptions
from tokenspeed_aio.server.routes_chat import chat_router
from tokenspeed_aio.server.routes_completions import completions_router
from tokenspeed_aio.server.routes_control import control_router
from tokenspeed_aio.server.routes_info import info_router
from tokenspeed_aio.server.routes_sglang import sglang_router
from tokenspeed_aio.server.routes_tokenize import tokenize_router

logger = logging.getLogger(__name__)

DRAIN_POLL_SECONDS = 0.05
ABORT_FLUSH_SECONDS = 5.0  # for aborted responses to reach their clients at a stop


def build_app(
    engine: AsyncEngine,
    *,
    served_model_name: str | list[str],
    api_key: str | None = None,
    max_body_bytes: int | None = None,
    options: ServerOptions | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``.

    ``served_model_name``: the name responses carry (the first of a list; requests may use
    any). ``options`` (ServerOptions) holds the server flags; ``api_key`` and
    ``max_body_bytes`` are shorthands for two of them.
    """
    options = options or ServerOptions()
    if api_key is not None:
        options = dataclasses.replace(options, api_key=api_key)
    if max_body_bytes is not None:
        options = dataclasses.replace(options, max_body_bytes=max_body_bytes)
    names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
    frontend = engine.frontend
    metrics = ServerMetrics(frontend, names[0])
    args = engine.args
    ctx = ServerContext(
        frontend,
        names[0],
        metrics,
        options=options,
        served_model_names=tuple(names),
        generation_defaults=generation_defaults(args.model or "", args.generation_config)
        if args.model
        else {},
        model_path=str(args.model or ""),
        engine_args=dataclasses.asdict(args),
    )
    app = FastAPI(title="tokenspeed_aio", summary="OpenAI-compatible LLM serving")
    app.state.context = ctx
    install_error_handlers(app)
    routers = (
        info_router, completions_router, chat_router, sglang_router, control_router,
        tokenize_router,
    )  # fmt: skip
    for router in routers:
        app.include_router(router(ctx))
    install_openapi(app)
    app.add_middleware(
        GuardMiddleware,
        api_key=options.api_key,
        metrics_api_key=options.metrics_api_key,
        admin_api_key=options.admin_api_key,
        allowed_origins=options.allowed_origins,
        allowed_hosts=options.allowed_hosts,
        draining=lambda: ctx.draining,
        max_body_bytes=options.max_body_bytes,
        body_timeout=options.body_timeout_seconds,
        access_log=options.access_log,
        on_client_error=metrics.client_error,
    )
    # Outermost: a browser's preflight carries no API key and is answered here.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(options.allowed_origins),
        allow_methods=list(options.allowed_methods),
        allow_headers=list(options.allowed_headers),
        allow_credentials=options.allow_credentials,
    )
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now -- before the model loads -- so a port in use fails
    in a second. OSError names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        reason = "is already in use" if err.errno == 98 else f"cannot be bound ({err.strerror})"
        raise OSError(err.errno, f"{host}:{port} {reason}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, with two changes to its signal handling: it takes SIGINT/SIGTERM
    only where nobody else has (a caller with its own handlers stops us by
    cancelling serve_http), and it does not re-raise the signal once stopped:
    serve_http returns, and its caller shuts the engine down."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only; whoever runs it stops us
            return
        defaults = (signal.SIG_DFL, signal.default_int_handler, None)
        ours = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) in defaults]
        original = {sig: signal.signal(sig, self.handle_exit) for sig in ours}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def _serve(server: _Server, host: str, port: int, sock: socket.socket | None = None) -> None:
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    except SystemExit:  # uvicorn's answer to a failed bind; it would end the whole loop
        raise OSError(f"the HTTP server could not listen on {host}:{port}; see the log") from None


async def serve_http(
    app: FastAPI,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    drain_seconds: float = 5.0,
    access_log: bool = False,
    sock: socket.socket | None = None,
    limits: ConnectionLimits | None = None,
    keep_alive_seconds: float = 5.0,
) -> None:
    """Serve ``app`` on the running event loop until SIGINT/SIGTERM (in the main thread,
    unless the caller handles those itself) or until the calling task is cancelled;
    either stops gracefully: no new
    connections, in-flight requests get ``drain_seconds`` to finish, then they are
    cancelled (which aborts their engine requests). Returns once the server stopped
    (re-raises CancelledError when it was cancelled). ``sock``: an already bound socket
    (``bind_socket``) to serve on instead of binding ``host:port``; ``access_log``:
    uvicorn's own (the guard middleware writes ours); ``limits``: the connection limits
    (http_protocol.py); ``keep_alive_seconds``: how long an idle connection stays open."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        lifespan="off",
        http=protocol_class(limits or ConnectionLimits()),
        timeout_keep_alive=keep_alive_seconds,
        timeout_graceful_shutdown=drain_seconds,
    )
    server = _Server(config)
    serving = asyncio.create_task(_serve(server, host, port, sock), name="ts-http-server")
    try:
        await asyncio.shield(serving)
    except asyncio.CancelledError:
        server.should_exit = True
        await serving
        raise
    finally:
        # uvicorn cancels the requests still running after the drain but does not wait
        # for them; their cleanup (aborting engine requests) must end before we return.
        leftover = set(server.server_state.tasks)
        if leftover:
            await asyncio.wait(leftover, timeout=drain_seconds)


def connection_limits(options: ServerOptions) -> ConnectionLimits:
    return ConnectionLimits(
        max_head_bytes=options.max_header_bytes,
        max_headers=options.max_header_count,
        max_url_bytes=options.max_url_bytes,
        head_timeout=options.header_timeout_seconds,
        max_connections=options.max_connections,
        max_body_bytes=options.max_body_bytes,
        stream_send_buffer=options.stream_send_buffer,
    )


async def drain(ctx: ServerContext, timeout: float, cut: asyncio.Event) -> int:
    """Stop taking requests (they are answered 503 from now on) and let the running ones
    finish for up to ``timeout`` seconds, or until ``cut`` is set (a second signal);
    then abort what is left -- each choice ends with finish_reason "abort", each stream
    with its final chunk and [DONE] -- and wait briefly for those responses to go out.
    Returns the number of choices aborted."""
    ctx.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while ctx.registry.sequences and not cut.is_set() and loop.time() < deadline:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cut.wait(), min(DRAIN_POLL_SECONDS, deadline - loop.time()))
    aborted = ctx.registry.abort_all()
    if aborted:
        logger.info("drain: aborted %d running choices", len(aborted))
    deadline = loop.time() + ABORT_FLUSH_SECONDS
    while ctx.registry.sequences and not cut.is_set() and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_SECONDS)
    return len(aborted)
