"""What both transfer peers share: the ``ts-pd`` event loop on its own thread, the
event queue the control plane polls, and the narrow control face it is handed."""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import random
import threading
from collections.abc import Callable, Coroutine

from tokenspeed_aio.control.pd import PeerEvent
from tokenspeed_aio.wire.messages import Bootstrap

logger = logging.getLogger(__name__)

SWEEP_SECONDS = 0.25  # how often timeouts are checked and the gauges refreshed
CONNECT_SECONDS = 5.0  # one attempt to reach a peer's server
# A decode rank pings each prefill rank it holds a connection to this often; the prefill
# rank takes it for dead (and fails its rooms) after this long without a frame from it.
HEARTBEAT_SECONDS = 1.0
HEARTBEAT_LAPSE_SECONDS = 5.0


class PeerError(Exception):
    """A transfer cannot go on; ``status`` is what its client is told (400: the request
    or the deployment is wrong, 503: a peer is unreachable or failed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def new_instance() -> int:
    """A peer's identity for one start: another start is another peer, whatever its
    address (63 bits, so it travels as a msgpack int)."""
    return random.SystemRandom().getrandbits(63)


class PeerLoop(abc.ABC):
    """The peer's event loop, run by its own thread. The control plane and the forward
    thread only queue calls onto it; what it learns comes back through ``poll``. A
    subclass is one side: how it registers and cancels a request's room."""

    role = ""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._events: collections.deque[PeerEvent] = collections.deque()
        self._gauges = (0, 0)
        self._tasks: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine, timeout: float | None = None):
        """Run a coroutine on the peer's loop and wait for it (startup and shutdown only)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """A task of the peer's loop that is kept until it ends; its failure is logged."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("transfer peer task failed", exc_info=task.exception())

    def emit(self, event: PeerEvent) -> None:
        self._events.append(event)

    # -- the control face ---------------------------------------------------------------
    def poll(self) -> list[PeerEvent]:
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events

    def gauges(self) -> tuple[int, int]:
        return self._gauges

    def register(self, rid: str, bootstrap: Bootstrap) -> None:
        self.call(self._register, rid, bootstrap)

    def cancel(self, rid: str) -> None:
        self.call(self._cancel, rid)

    @abc.abstractmethod
    def _register(self, rid: str, bootstrap: Bootstrap) -> None:
        """On the peer's loop: track a request's room."""

    @abc.abstractmethod
    def _cancel(self, rid: str) -> None:
        """On the peer's loop: stop a request's room, retiring it once safe."""

    # -- shutdown ---------------------------------------------------------------------
    async def _aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self) -> None:
        if not self.loop.is_running():
            return
        try:
            self.run(self._aclose(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


class PeerControl:
    """What the control plane holds of a peer (control.pd.TransferPeer): registration,
    cancellation, the poll and the gauges -- not the peer, its engine or its memory."""

    __slots__ = ("_peer", "role")

    def __init__(self, peer: PeerLoop) -> None:
        self._peer = peer
        self.role = peer.role

    def register(self, rid: str, bootstrap: Bootstrap) -> None:
        self._peer.register(rid, bootstrap)

    def cancel(self, rid: str) -> None:
        self._peer.cancel(rid)

    def poll(self) -> list[PeerEvent]:
        return self._peer.poll()

    def gauges(self) -> tuple[int, int]:
        return self._peer.gauges()
