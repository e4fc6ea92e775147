"""AsyncEngine: the engine embedded in the caller's asyncio service, and the composition
root every entry point shares (the HTTP server holds one too).

With one rank the control plane runs as a task in the caller's own event loop
(the forward thread does the device work beside it). With several ranks -- or when
asked, as the server does -- it starts rank processes and talks to them over the
ZMQ wire.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from tokenspeed_aio.api.control import EngineControl
from tokenspeed_aio.api.frontend import Frontend
from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.api.stream import OutputKind
from tokenspeed_aio.api.tracing import RequestTracer, trace_provider
from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.control.transport import LocalTransport
from tokenspeed_aio.errors import EngineDeadError
from tokenspeed_aio.model_source import resolve_model_path
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.tokenization.tokenizer import Tokenizer
from tokenspeed_aio.wire.messages import Bootstrap, InboundMessage, OutputBatch, StopEngine

if TYPE_CHECKING:
    from tokenspeed_aio.engine.launcher import ShutdownLatch

logger = logging.getLogger(__name__)


class _LocalConnection:
    """The frontend's side of the in-process wire; the engine task's end ends it."""

    def __init__(self, transport: LocalTransport) -> None:
        self.transport = transport

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


class _LocalRank:
    """One rank in this process: its control plane is a task of the caller's loop."""

    def __init__(self, rank, transport: LocalTransport) -> None:
        self.rank = rank
        self.transport = transport
        self.connection = _LocalConnection(transport)
        self.task = asyncio.create_task(rank.serve(), name="ts-engine-rank")
        self.task.add_done_callback(self.connection.engine_stopped)
        self.max_model_len = rank.specs.max_model_len
        self.vocab_size = rank.specs.vocab_size
        self.eos_token_ids = rank.specs.eos_token_ids
        self.role = rank.specs.role

    async def stopped(self) -> str:
        await asyncio.wait({self.task})
        exc = None if self.task.cancelled() else self.task.exception()
        return f"the engine loop failed: {exc!r}" if exc else "the engine loop stopped"

    def idle(self, frontend: Frontend) -> bool:
        return self.rank.loop.idle()

    def check_idle(self, frontend: Frontend) -> None:
        self.rank.loop.check_idle()

    async def stop(self) -> None:
        if not self.task.done():
            self.transport.put(StopEngine())
            await asyncio.wait({self.task}, timeout=30)
        await self.connection.close()
        await asyncio.gather(self.task, return_exceptions=True)


class _RemoteRanks:
    """Rank processes behind the ZMQ wire; their state is seen through load reports.
    A rank that exits fails every request at once (the frontend never hangs on it)."""

    def __init__(self, processes) -> None:
        self.processes = processes
        self.connection = processes.client
        self.max_model_len = processes.max_model_len
        self.vocab_size = processes.registrations[0].vocab_size
        self.eos_token_ids = processes.registrations[0].eos_token_ids
        self.role = processes.registrations[0].role
        self._watch: asyncio.Task | None = None

    def supervise(self, frontend: Frontend) -> None:
        def rank_exited(task: asyncio.Task) -> None:
            if not task.cancelled():
                frontend.fail_all(EngineDeadError(f"the engine died: {task.result()}"))

        self._watch = asyncio.create_task(self.processes.launcher.watch(), name="ts-rank-watch")
        self._watch.add_done_callback(rank_exited)

    async def stopped(self) -> str:
        await asyncio.wait({self._watch})
        return "the engine stopped" if self._watch.cancelled() else self._watch.result()

    def idle(self, frontend: Frontend) -> bool:
        loads = [frontend.loads.get(r) for r in range(frontend.num_replicas)]
        return all(
            ld is not None and not (ld[0].running or ld[0].waiting or ld[0].active_blocks)
            for ld in loads
        )

    def check_idle(self, frontend: Frontend) -> None:
        """Idle as the replicas reported it: no request and no active block."""
        if not self.idle(frontend):
            raise AssertionError(f"the replicas are not idle: {frontend.loads}")

    async def stop(self) -> None:
        self._watch.cancel()
        await asyncio.gather(self._watch, return_exceptions=True)
        await self.processes.stop()


def _provider(args: EngineArgs):
    return trace_provider(args.trace_provider) if args.trace_provider else None


class AsyncEngine(EngineControl):
    """The engine: ``generate`` streams; the control operations (pause, memory release,
    weight updates, profiling) are EngineControl's (api/control.py)."""

    def __init__(self, args: EngineArgs, frontend: Frontend, backend) -> None:
        self.args = args
        self.frontend = frontend
        self._backend = backend
        self._closed = False

    @classmethod
    async def start(
        cls,
        args: EngineArgs | None = None,
        *,
        rank_processes: bool | None = None,
        log_level: str = "INFO",
        latch: ShutdownLatch | None = None,
        trace_exporter=None,
    ) -> AsyncEngine:
        """Load the tokenizer, start the ranks and connect the frontend to them.

        ``rank_processes``: run the ranks in their own processes (default: only with more
        than one rank); ``log_level`` and ``latch`` (the shutdown latch a rank failure
        trips) apply to those processes. Raises RankFailure when a rank fails at startup.
        """
        args = args or EngineArgs()
        model_path = resolve_model_path(args.model)
        args = args.replace(model=str(model_path))
        tokenizer = await asyncio.to_thread(
            Tokenizer, args.tokenizer or model_path, args.chat_template
        )
        if rank_processes is None:
            rank_processes = args.world_size > 1
        if rank_processes:
            from tokenspeed_aio.engine.processes import start_engine_processes

            processes = await start_engine_processes(args, log_level=log_level, latch=latch)
            backend = _RemoteRanks(processes)
        else:
            from tokenspeed_aio.engine.rank import EngineRank

            transport = LocalTransport()
            backend = _LocalRank(await EngineRank.start(args, transport), transport)
        tracer = (
            RequestTracer(exporter=trace_exporter, provider=_provider(args))
            if trace_exporter is not None
            else RequestTracer.from_args(args)
        )
        frontend = Frontend(
            tokenizer,
            backend.connection,
            max_model_len=backend.max_model_len,
            vocab_size=backend.vocab_size,
            eos_token_ids=backend.eos_token_ids,
            num_replicas=args.dp,
            weight_version=args.weight_version,
            tracer=tracer,
            role=backend.role,
        )
        if isinstance(backend, _RemoteRanks):
            backend.supervise(frontend)  # in-process, the task's end reaches it by the wire
        return cls(args, frontend, backend)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frontend.tokenizer

    def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        rid: str | None = None,
        bootstrap: Bootstrap | None = None,
        output_kind: OutputKind = "cumulative",
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Cancelling the consumer aborts the request.

        ``bootstrap``: on a prefill or decode engine, the request's half of a
        disaggregated request (the prefill engine's bootstrap server and the room the
        gateway named for it). ``output_kind``: ``cumulative`` (each output holds
        everything generated so far) or ``delta`` (only what is new: the frontend then
        keeps no tokens of a long stream)."""
        return self.frontend.generate(
            prompt,
            sampling_params,
            prompt_token_ids=prompt_token_ids,
            rid=rid,
            bootstrap=bootstrap,
            output_kind=output_kind,
        )

    def abort(self, rid: str) -> None:
        self.frontend.abort(rid)

    async def stopped(self) -> str:
        """Wait until the engine stops on its own (a rank died, the loop failed or was
        stopped) and say why; every request still running has failed by then."""
        return await self._backend.stopped()

    async def shutdown(self) -> None:
        """Stop after the current round; requests still running end with an error."""
        if self._closed:
            return
        self._closed = True
        self.frontend.fail_all(EngineDeadError("the engine was shut down"))
        await self.frontend.close()
        await self._backend.stop()

    async def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no request is held anywhere (frontend, control plane, scheduler)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        frontend = self.frontend
        while frontend.streams or frontend.draining or not self._backend.idle(frontend):
            if loop.time() > deadline:
                return
            await asyncio.sleep(0.01)

    async def check_idle(self, timeout: float = 10.0) -> None:
        """Leak check for tests and drains: raises AssertionError naming what is held."""
        await self.wait_idle(timeout)
        if self.frontend.streams:
            raise AssertionError(f"frontend still streams {list(self.frontend.streams)[:8]}")
        if self.frontend.draining:
            ending = list(self.frontend.draining)[:8]
            raise AssertionError(f"frontend still awaits the final output of {ending}")
        self._backend.check_idle(self.frontend)

    @property
    def control_loop(self):
        """The in-process EventLoop (one rank), for introspection: its scheduler, round
        stats, KV events. None when the ranks run in their own processes."""
        return getattr(self._backend, "rank", None) and self._backend.rank.loop
