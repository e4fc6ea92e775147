"""Several HTTP apps with different server options in front of ONE engine, on their own
uvloop thread: a test of many server flags (tool parsers, reasoning parsers, API keys)
pays for one engine start. Tests reach each app only over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import uvloop

from helpers.server import wait_healthy
from tokenspeed_aio.api.engine import AsyncEngine
from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.server.app import bind_socket, build_app, serve_http
from tokenspeed_aio.server.options import ServerOptions

ENGINE_ARGS = dict(max_model_len=1024, page_size=4, num_kv_blocks=1024, max_num_seqs=64)


class AppsThread(threading.Thread):
    def __init__(
        self, model: Path, apps: dict[str, ServerOptions | tuple[ServerOptions, list[str]]],
        **engine_args,
    ) -> None:  # fmt: skip
        super().__init__(name="test-apps", daemon=True)
        self.model = model
        self.apps = apps
        self.engine_args = {**ENGINE_ARGS, **engine_args}
        self.urls: dict[str, str] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tasks: list[asyncio.Task] = []
        self.error: BaseException | None = None
        self.ready = threading.Event()

    def run(self) -> None:
        try:
            uvloop.run(self._main())
        except BaseException as exc:
            self.error = exc
        finally:
            self.ready.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        engine = await AsyncEngine.start(EngineArgs(model=str(self.model), **self.engine_args))
        try:
            for name, options in self.apps.items():
                names = ["tiny"]
                if isinstance(options, tuple):
                    options, names = options
                sock = bind_socket("127.0.0.1", 0)
                self.urls[name] = f"http://127.0.0.1:{sock.getsockname()[1]}"
                app = build_app(engine, served_model_name=names, options=options)
                serving = serve_http(
                    app, "127.0.0.1", 0, log_level="warning", drain_seconds=1.0, sock=sock
                )
                self.tasks.append(asyncio.create_task(serving))
            self.ready.set()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await engine.check_idle()
        finally:
            await engine.shutdown()

    def stop(self) -> None:
        if self.loop is not None:
            for task in self.tasks:
                self.loop.call_soon_threadsafe(task.cancel)
        self.join(timeout=60)


@contextlib.contextmanager
def serve_apps(model: Path, apps: dict, **engine_args) -> Iterator[dict]:
    """{app name: base URL} while the apps serve (each app's value: its ServerOptions, or
    (options, served model names)); the engine is leak-checked at the end."""
    thread = AppsThread(model, apps, **engine_args)
    thread.start()
    try:
        thread.ready.wait(180)
        if thread.error is not None or not thread.urls:
            raise RuntimeError("the apps did not start") from thread.error
        for url in thread.urls.values():
            wait_healthy(url, thread.is_alive)
        yield thread.urls
    finally:
        thread.stop()
    if thread.error is not None:
        raise thread.error
