"""``serve``: the frontend process. Starts the rank processes, waits for them and
their registrations, then serves HTTP until a signal, a dead rank or a failure.

Exit status: 0 after an orderly stop (SIGINT/SIGTERM), non-zero when a rank died
or startup failed -- never a hang.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.engine.launcher import RankFailure, ShutdownLatch
from tokenspeed_aio.gc_policy import freeze_startup_heap

logger = logging.getLogger("tokenspeed_aio.serve")


def run_server(args: EngineArgs, ns: argparse.Namespace) -> int:
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    async_logs = None
    if args.enable_async_logging:
        from tokenspeed_aio.engine.async_logging import AsyncLogging

        async_logs = AsyncLogging()
        async_logs.install()
    try:
        try:
            import uvloop

            return uvloop.run(_serve(args, ns))
        except ImportError:
            return asyncio.run(_serve(args, ns))
    finally:
        if async_logs is not None:
            async_logs.shutdown()


async def _serve(args: EngineArgs, ns: argparse.Namespace) -> int:
    from tokenspeed_aio.api.engine import AsyncEngine
    from tokenspeed_aio.server.app import (
        bind_socket,
        build_app,
        connection_limits,
        drain,
        serve_http,
    )
    from tokenspeed_aio.server.options import ServerOptions

    names = args.served_model_names or [Path(args.model or "tokenspeed-default").name]
    latch = ShutdownLatch()
    latch.install_signal_handlers()
    if args.node_rank > 0:
        from tokenspeed_aio.engine.processes import run_headless_node

        return await run_headless_node(args, latch, ns.log_level)
    options = ServerOptions.from_flags(ns)
    try:  # before the model loads: a port in use fails now, not minutes from now
        sock = bind_socket(ns.host, ns.port)
    except OSError as err:
        logger.error("cannot serve: %s", err.strerror or err)
        return 1
    starting = asyncio.ensure_future(
        AsyncEngine.start(args, rank_processes=True, log_level=ns.log_level, latch=latch)
    )
    await asyncio.wait(
        {starting, asyncio.ensure_future(latch.requested.wait())},
        return_when=asyncio.FIRST_COMPLETED,
    )
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        sock.close()
        logger.info("stopped during startup (%s)", latch.reason)
        return 0
    try:
        engine = starting.result()
    except (RankFailure, ValueError, OSError) as err:
        logger.error("engine startup failed: %s", err)
        sock.close()
        return 1
    app = build_app(engine, served_model_name=names, options=options)
    # Measured on the 2-core CPU server, a 4-token request sent while a 16,000-sequence
    # request fans out: 0.35-0.47 s before, 0.22-0.33 s after (test_fairness_http.py).
    freeze_startup_heap(automatic_full_collections=True)
    http = asyncio.ensure_future(
        serve_http(
            app,
            ns.host,
            ns.port,
            log_level=ns.log_level,
            sock=sock,
            limits=connection_limits(options),
            keep_alive_seconds=options.keep_alive_seconds,
        )
    )
    engine_stopped = asyncio.ensure_future(engine.stopped())
    stop = asyncio.ensure_future(latch.requested.wait())
    _announce(ns.host, ns.port, names[0])
    await asyncio.wait({http, engine_stopped, stop}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if engine_stopped.done():
        logger.error("the engine died: %s", engine_stopped.result())
        code = 1
    elif http.done() and http.exception() is not None:
        logger.error("the HTTP server failed: %r", http.exception())
        code = 1
    else:  # a signal: drain, unless the engine dies meanwhile
        logger.info(
            "stopping (%s): draining for up to %g s", latch.reason, options.shutdown_timeout_seconds
        )
        draining = asyncio.ensure_future(
            drain(app.state.context, options.shutdown_timeout_seconds, latch.repeated)
        )
        await asyncio.wait({draining, engine_stopped}, return_when=asyncio.FIRST_COMPLETED)
        if engine_stopped.done():
            logger.error("the engine died while draining: %s", engine_stopped.result())
            code = 1
        draining.cancel()
        await asyncio.gather(draining, return_exceptions=True)
    http.cancel()
    await asyncio.gather(http, return_exceptions=True)
    engine_stopped.cancel()
    stop.cancel()
    await engine.shutdown()  # StopEngine to every replica, then reap the rank processes
    logger.info("stopped")
    return code


def _announce(host: str, port: int, name: str) -> None:
    url = f"http://{host}:{port}"
    print(
        f"tokenspeed_aio serving {name!r} on {url}\n"
        f"try: curl {url}/v1/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{name}", "prompt": "The for statement", "max_tokens": 32, '
        f'"temperature": 0}}\'',
        file=sys.stderr,
        flush=True,
    )
