"""The server under test, started once per session by ONE fixture, ``http_server``.

``SERVER = "thread"`` runs it in-process: an AsyncEngine on a tiny checkpoint and
uvicorn (``serve_http``) on their own uvloop thread, leak-checked at the end.
``SERVER = "subprocess"`` runs ``python -m tokenspeed_aio serve`` instead, stopped
with SIGTERM. Either way tests reach it only over real HTTP. Tests that need an
engine of their own (reference outputs, a server that starts late) start one with
``start_engine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvloop
from helpers.reference import checkpoint_path
from helpers.server import wait_healthy
from helpers.server import wait_idle as wait_until_idle

from tokenspeed_aio.api.engine import AsyncEngine
from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.bench.deployment import parse_metrics
from tokenspeed_aio.bench.ports import free_port
from tokenspeed_aio.server.app import build_app, serve_http

SERVER = "subprocess"  # or "thread" (faster, in-process)
API_KEY = "test-key"
MODEL = "tiny-llama"
ENGINE_ARGS = dict(max_model_len=1024, page_size=4, num_kv_blocks=1024, max_num_seqs=128)
STARTUP_SECONDS = 120


@dataclass(frozen=True)
class ServerHandle:
    base_url: str
    api_key: str
    model: str  # the served model name
    checkpoint: Path
    max_model_len: int

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


class _ServerThread(threading.Thread):
    """An engine and its HTTP server on their own event loop; stopping it cancels
    serve_http (a graceful stop), leak-checks the engine and shuts it down."""

    def __init__(self, checkpoint: Path, port: int) -> None:
        super().__init__(name="test-http-server", daemon=True)
        self.checkpoint = checkpoint
        self.port = port
        self.loop: asyncio.AbstractEventLoop | None = None
        self.serving: asyncio.Task | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            uvloop.run(self._main())
        except BaseException as exc:  # reported by the fixture, in the test thread
            self.error = exc

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        engine = await AsyncEngine.start(EngineArgs(model=str(self.checkpoint), **ENGINE_ARGS))
        try:
            app = build_app(engine, served_model_name=MODEL, api_key=API_KEY)
            self.serving = asyncio.create_task(
                serve_http(app, "127.0.0.1", self.port, log_level="warning", drain_seconds=1.0)
            )
            with contextlib.suppress(asyncio.CancelledError):
                await self.serving
            await engine.check_idle()
        finally:
            await engine.shutdown()

    def stop(self) -> None:
        if self.loop is not None and self.serving is not None:
            self.loop.call_soon_threadsafe(self.serving.cancel)
        self.join(timeout=60)


@contextlib.contextmanager
def _serve_in_thread(checkpoint: Path, port: int) -> Iterator[None]:
    thread = _ServerThread(checkpoint, port)
    thread.start()
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", thread.is_alive)
        except RuntimeError as exc:
            raise exc from thread.error
        yield
    finally:
        thread.stop()
    if thread.error is not None:
        raise thread.error


@contextlib.contextmanager
def _serve_in_subprocess(checkpoint: Path, port: int) -> Iterator[None]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    cmd = [
        sys.executable, "-m", "tokenspeed_aio", "serve", f"--model={checkpoint}",
        f"--port={port}", f"--api-key={API_KEY}", f"--served-model-name={MODEL}",
        "--log-level=warning", *flags,
    ]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", lambda: proc.poll() is None)
            yield
        except BaseException:
            log.seek(0)
            print(log.read().decode(errors="replace")[-5000:])  # the server's side of it
            raise
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, f"serve exited with {proc.returncode}"


@contextlib.contextmanager
def _start_server(checkpoint: Path) -> Iterator[ServerHandle]:
    port = free_port()
    serve = _serve_in_thread if SERVER == "thread" else _serve_in_subprocess
    with serve(checkpoint, port):
        yield ServerHandle(
            f"http://127.0.0.1:{port}", API_KEY, MODEL, checkpoint, ENGINE_ARGS["max_model_len"]
        )


@pytest.fixture(scope="session")
def server_checkpoint(tmp_path_factory) -> Path:
    return checkpoint_path(tmp_path_factory.mktemp("server-checkpoints"), "llama")


@pytest.fixture(scope="session")
def http_server(server_checkpoint) -> Iterator[ServerHandle]:
    """The running server (its engine is leak-checked when the session ends)."""
    with _start_server(server_checkpoint) as handle:
        yield handle


@pytest.fixture
async def start_engine(server_checkpoint) -> AsyncIterator:
    """start_engine() -> an AsyncEngine on the server's checkpoint, in the test's loop;
    leak-checked and shut down at teardown."""
    engines: list[AsyncEngine] = []

    async def start() -> AsyncEngine:
        engine = await AsyncEngine.start(EngineArgs(model=str(server_checkpoint), **ENGINE_ARGS))
        engines.append(engine)
        return engine

    yield start
    try:
        for engine in engines:
            if engine.frontend.dead is None:
                await engine.check_idle()
    finally:
        for engine in engines:
            await engine.shutdown()


async def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {name{labels}: value} (label sets as written, minus model_name)."""
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        return parse_metrics((await client.get(f"{base_url}/metrics")).text, MODEL)


async def wait_idle(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until nothing of a request is held, from the HTTP layer to the engine's
    KV blocks; raise naming what still is."""
    return await wait_until_idle(lambda: scrape(base_url), timeout)
