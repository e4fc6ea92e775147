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
from tokenspeed_aio.model_source import resolve_model_path

logger = logging.getLogger("tokenspeed_aio.serve")


def run_server(args: EngineArgs, ns: argparse.Namespace) -> int:
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop

        return uvloop.run(_serve(args, ns))
    except ImportError:
        return asyncio.run(_serve(args, ns))


async def _serve(args: EngineArgs, ns: argparse.Namespace) -> int:
    from tokenspeed_aio.api.frontend import Frontend
    from tokenspeed_aio.engine.processes import start_engine_processes
    from tokenspeed_aio.errors import EngineDeadError
    from tokenspeed_aio.server.app import build_app, serve_http
    from tokenspeed_aio.tokenization.tokenizer import Tokenizer

    model_path = resolve_model_path(args.model)
    name = args.served_model_name or (
        "tokenspeed-default" if args.model is None else Path(model_path).name
    )
    args = args.replace(model=str(model_path), served_model_name=name)
    latch = ShutdownLatch()
    latch.install_signal_handlers()
    if args.node_rank > 0:
        from tokenspeed_aio.engine.processes import run_headless_node

        return await run_headless_node(args, latch, ns.log_level)
    tokenizer = await asyncio.to_thread(Tokenizer, args.tokenizer or model_path, args.chat_template)
    starting = asyncio.ensure_future(
        start_engine_processes(args, log_level=ns.log_level, latch=latch)
    )
    await asyncio.wait(
        {starting, asyncio.ensure_future(latch.requested.wait())},
        return_when=asyncio.FIRST_COMPLETED,
    )
    if not starting.done():
        starting.cancel()
        logger.info("stopped during startup (%s)", latch.reason)
        return 0
    try:
        engine = starting.result()
    except RankFailure as err:
        logger.error("engine startup failed: %s", err)
        return 1
    frontend = Frontend(
        tokenizer,
        engine.client,
        max_model_len=engine.max_model_len,
        vocab_size=engine.registrations[0].vocab_size,
        num_replicas=args.dp,
    )
    app = build_app(
        frontend, served_model_name=name, api_key=ns.api_key, max_body_bytes=ns.max_body_bytes
    )
    http = asyncio.ensure_future(serve_http(app, ns.host, ns.port, log_level=ns.log_level))
    rank_exit = asyncio.ensure_future(engine.launcher.watch())
    stop = asyncio.ensure_future(latch.requested.wait())
    _announce(ns.host, ns.port, name)
    await asyncio.wait({http, rank_exit, stop}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if rank_exit.done():
        logger.error("an engine rank died: %s", rank_exit.result())
        frontend.fail_all(EngineDeadError(f"the engine died: {rank_exit.result()}"))
        code = 1
    elif http.done() and http.exception() is not None:
        logger.error("the HTTP server failed: %r", http.exception())
        code = 1
    http.cancel()
    await asyncio.gather(http, return_exceptions=True)
    rank_exit.cancel()
    stop.cancel()
    await frontend.close()
    await engine.stop()  # StopEngine to every replica, then reap the rank processes
    if code == 0 and any(c not in (0, None) for c in engine.launcher.exit_codes()):
        logger.warning("rank exit codes at shutdown: %s", engine.launcher.exit_codes())
    logger.info("stopped")
    return code


def _announce(host: str, port: int, name: str) -> None:
    url = f"http://{host}:{port}"
    print(
        f"tokenspeed_aio serving {name!r} on {url}\n"
        f"try: curl {url}/v1/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{name}", "prompt": "The for statement", "max_tokens": 32}}\'',
        file=sys.stderr,
        flush=True,
    )
