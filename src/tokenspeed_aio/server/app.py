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
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from tokenspeed_aio.api.engine import AsyncEngine
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import install_error_handlers
from tokenspeed_aio.server.metrics import ServerMetrics
from tokenspeed_aio.server.middleware import GuardMiddleware
from tokenspeed_aio.server.openapi import install_openapi
from tokenspeed_aio.server.routes_chat import chat_router
from tokenspeed_aio.server.routes_completions import completions_router
from tokenspeed_aio.server.routes_control import control_router
from tokenspeed_aio.server.routes_gateway import gateway_router
from tokenspeed_aio.server.routes_info import info_router
from tokenspeed_aio.server.routes_sglang import sglang_router

logger = logging.getLogger(__name__)

MiB = 1 << 20


def build_app(
    engine: AsyncEngine,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 8 * MiB,
) -> FastAPI:
    """The FastAPI app serving ``engine``.

    ``api_key``: when set, every route but /health answers 401 without
    ``Authorization: Bearer <api_key>``. ``max_body_bytes``: larger request bodies
    get 413.
    """
    frontend = engine.frontend
    metrics = ServerMetrics(frontend, served_model_name)
    ctx = ServerContext(frontend, served_model_name, metrics)
    app = FastAPI(title="tokenspeed_aio", summary="OpenAI-compatible LLM serving")
    app.state.context = ctx
    install_error_handlers(app)
    routers = (info_router, completions_router, chat_router, sglang_router, control_router)
    for router in routers:
        app.include_router(router(ctx))
    app.include_router(gateway_router(ctx, engine.args))
    install_openapi(app)
    app.add_middleware(
        GuardMiddleware,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        on_client_error=metrics.client_error,
    )
    return app


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


async def _serve(server: _Server, host: str, port: int) -> None:
    try:
        await server.serve()
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
) -> None:
    """Serve ``app`` on the running event loop until SIGINT/SIGTERM (in the main thread,
    unless the caller handles those itself) or until the calling task is cancelled;
    either stops gracefully: no new
    connections, in-flight requests get ``drain_seconds`` to finish, then they are
    cancelled (which aborts their engine requests). Returns once the server stopped
    (re-raises CancelledError when it was cancelled)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        lifespan="off",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=drain_seconds,
    )
    server = _Server(config)
    serving = asyncio.create_task(_serve(server, host, port), name="ts-http-server")
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
