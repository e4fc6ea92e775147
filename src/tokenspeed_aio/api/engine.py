"""AsyncEngine: the engine embedded in the caller's asyncio service.

With one rank the control plane runs as a task in the caller's own event loop
(the forward thread does the device work beside it). With several ranks it
starts the rank processes and talks to them over the ZMQ wire the server uses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from tokenspeed_aio.api.errors import EngineDeadError
from tokenspeed_aio.api.frontend import Frontend
from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.api.sampling_params import SamplingParams
from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.control.transport import LocalTransport
from tokenspeed_aio.model_source import resolve_model_path
from tokenspeed_aio.server.tokenizer import Tokenizer
from tokenspeed_aio.wire.messages import InboundMessage, OutputBatch, StopEngine

logger = logging.getLogger(__name__)


class _LocalConnection:
    """The frontend's side of the in-process wire; the engine task's death ends it."""

    def __init__(self, transport: LocalTransport) -> None:
        self.transport = transport
        self._failure: BaseException | None = None

    def send(self, msg: InboundMessage, replica: int) -> None:
        self.transport.put(msg)

    async def receive(self) -> OutputBatch:
        item = await self.transport.outputs.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def engine_stopped(self, task: asyncio.Task) -> None:
        exc = None if task.cancelled() else task.exception()
        reason = f"the engine loop failed: {exc!r}" if exc else "the engine loop stopped"
        self.transport.outputs.put_nowait(ConnectionError(reason))

    async def close(self) -> None:
        await self.transport.close()


class AsyncEngine:
    def __init__(self, args: EngineArgs, frontend: Frontend, rank, task: asyncio.Task) -> None:
        self.args = args
        self.frontend = frontend
        self._rank = rank
        self._task = task
        self._closed = False

    @classmethod
    async def start(cls, args: EngineArgs | None = None) -> AsyncEngine:
        from tokenspeed_aio.rank import EngineRank

        args = args or EngineArgs()
        if args.world_size > 1:
            raise NotImplementedError  # replaced by the multi-rank path below
        model_path = resolve_model_path(args.model)
        tokenizer = await asyncio.to_thread(
            Tokenizer, args.tokenizer or model_path, args.chat_template
        )
        transport = LocalTransport()
        rank = await EngineRank.start(args.replace(model=str(model_path)), transport)
        task = asyncio.create_task(rank.serve(), name="ts-engine-rank")
        connection = _LocalConnection(transport)
        task.add_done_callback(connection.engine_stopped)
        frontend = Frontend(tokenizer, connection, max_model_len=rank.specs.max_model_len)
        return cls(args, frontend, rank, task)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frontend.tokenizer

    @property
    def specs(self):
        return self._rank.specs

    def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        rid: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Cancelling the consumer aborts the request."""
        return self.frontend.generate(
            prompt, sampling_params, prompt_token_ids=prompt_token_ids, rid=rid
        )

    def abort(self, rid: str) -> None:
        self.frontend.abort(rid)

    async def shutdown(self) -> None:
        """Stop after the current round: in-flight requests end with ``abort``."""
        if self._closed:
            return
        self._closed = True
        self.frontend.fail_all(EngineDeadError("the engine was shut down"))
        if not self._task.done():
            self._rank.loop.relay.transport.put(StopEngine())
            await asyncio.wait({self._task}, timeout=30)
        await self.frontend.close()
        await self.frontend.connection.close()
        await asyncio.gather(self._task, return_exceptions=True)

    async def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no request is held anywhere (frontend, control plane, scheduler)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.frontend.streams or not self._rank.loop.idle():
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.01)

    async def check_idle(self, timeout: float = 10.0) -> None:
        """Leak check for tests and drains: raises AssertionError naming what is held."""
        await self.wait_idle(timeout)
        if self.frontend.streams:
            raise AssertionError(f"frontend still streams {list(self.frontend.streams)[:8]}")
        self._rank.loop.check_idle()
