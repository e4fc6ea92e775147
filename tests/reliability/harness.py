"""The real server for the reliability tests: ``python -m tokenspeed_aio serve`` as a
subprocess on a tiny checkpoint (mirroring tests/server/conftest.py, with the flags
each module needs), plus what the tests read off it: /metrics, the process tree's
RSS and the server's log."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from helpers.server import wait_healthy, wait_idle

from tokenspeed_aio.bench.deployment import parse_metrics
from tokenspeed_aio.bench.ports import free_port

API_KEY = "reliability-key"
MODEL = "tiny-llama"
STARTUP_SECONDS = 120
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@dataclass
class Server:
    proc: subprocess.Popen | None  # None: the in-process ThreadServer
    base_url: str
    api_key: str | None
    checkpoint: Path
    max_model_len: int
    log_path: Path | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def client(self, **kw) -> httpx.AsyncClient:
        kw.setdefault("timeout", 60)
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def processes(self) -> list[psutil.Process]:
        """The frontend and its rank processes."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def rss(self) -> int:
        """Resident memory of the whole tree, bytes."""
        total = 0
        for p in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
        return total

    async def metrics(self) -> dict[str, float]:
        """/metrics as {name{labels}: value}, the model_name label removed."""
        async with self.client() as c:
            return parse_metrics((await c.get("/metrics")).text, MODEL)

    async def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until nothing of a request is held, from the HTTP layer to the
        engine's KV blocks; raise naming what still is."""
        return await wait_idle(self.metrics, timeout)


@contextlib.contextmanager
def run_server(
    checkpoint: Path,
    log_dir: Path,
    *,
    api_key: str | None = API_KEY,
    host: str | None = None,
    connect_host: str = "127.0.0.1",
    log_level: str = "warning",
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    exit_code: int = 0,
    **engine: object,
) -> Iterator[Server]:
    """``serve`` on a free port with ``--flag=value`` for each engine keyword; stopped
    with SIGTERM at the end, which must exit with ``exit_code`` (0: an orderly stop)."""
    settings = dict(max_model_len=256, page_size=4, num_kv_blocks=512, max_num_seqs=64)
    settings.update(engine)
    port = free_port()
    cmd = [
        sys.executable, "-m", "tokenspeed_aio", "serve", f"--model={checkpoint}",
        f"--port={port}", f"--served-model-name={MODEL}", f"--log-level={log_level}",
        *(f"--{k.replace('_', '-')}={v}" for k, v in settings.items()),
        *([f"--api-key={api_key}"] if api_key else []),
        *([f"--host={host}"] if host else []),
        *extra,
    ]  # fmt: skip
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"serve-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    base_url = f"http://{connect_host}:{port}"
    server = Server(proc, base_url, api_key, checkpoint, int(settings["max_model_len"]), log_path)
    try:
        wait_healthy(base_url, lambda: proc.poll() is None)
        yield server
    except BaseException:
        print(server.log()[-5000:])  # the server's side of the failure
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == exit_code, (
        f"serve exited with {proc.returncode}:\n{server.log()[-3000:]}"
    )


class ThreadServer(threading.Thread):
    """The server in this process: an AsyncEngine and uvicorn (``serve_http``) on their
    own uvloop thread, reached over real HTTP like the subprocess -- and, unlike it,
    inspectable: ``call`` runs a coroutine function on the server's loop (for
    ``engine.check_idle()`` and the HTTP layer's request registry)."""

    def __init__(self, checkpoint: Path, port: int, engine: dict) -> None:
        super().__init__(name="reliability-http-server", daemon=True)
        self.checkpoint = checkpoint
        self.port = port
        self.engine_kw = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine = None
        self.app = None
        self.serving: asyncio.Task | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        import uvloop

        try:
            uvloop.run(self._main())
        except BaseException as exc:  # reported by run_thread_server, in the test thread
            self.error = exc

    async def _main(self) -> None:
        from tokenspeed_aio.api.engine import AsyncEngine
        from tokenspeed_aio.args import EngineArgs
        from tokenspeed_aio.server.app import build_app, serve_http

        self.loop = asyncio.get_running_loop()
        args = EngineArgs(model=str(self.checkpoint), **self.engine_kw)
        self.engine = await AsyncEngine.start(args)
        try:
            self.app = build_app(self.engine, served_model_name=MODEL, api_key=API_KEY)
            self.serving = asyncio.create_task(
                serve_http(self.app, "127.0.0.1", self.port, log_level="warning", drain_seconds=1)
            )
            with contextlib.suppress(asyncio.CancelledError):
                await self.serving
        finally:
            await self.engine.shutdown()

    def call(self, fn, *args, timeout: float = 60):
        """Run ``await fn(*args)`` on the server's loop; its result."""
        return asyncio.run_coroutine_threadsafe(fn(*args), self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop is not None and self.serving is not None:
            self.loop.call_soon_threadsafe(self.serving.cancel)
        self.join(timeout=60)


@contextlib.contextmanager
def run_thread_server(checkpoint: Path, **engine: object) -> Iterator[tuple[Server, ThreadServer]]:
    settings = dict(max_model_len=256, page_size=4, num_kv_blocks=512, max_num_seqs=64)
    settings.update(engine)
    thread = ThreadServer(checkpoint, free_port(), settings)
    thread.start()
    base_url = f"http://127.0.0.1:{thread.port}"
    try:
        try:
            wait_healthy(base_url, thread.is_alive)
        except RuntimeError as exc:
            raise exc from thread.error
        yield (
            Server(None, base_url, API_KEY, checkpoint, int(settings["max_model_len"]), None),
            thread,
        )
    finally:
        thread.stop()
    if thread.error is not None:
        raise thread.error
