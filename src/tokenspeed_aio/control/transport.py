"""The frontend wire as the loop sees it, and the load-report policy.

``Transport`` is implemented in-process (``LocalTransport``, AsyncEngine with one
rank) and over ZMQ (wire/zmq_transport.py). Both carry the same msgspec messages.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from typing import Protocol

import msgspec

from tokenspeed_aio.wire.messages import (
    ITERATION_TOKEN_BUCKETS,
    ControlReply,
    InboundMessage,
    Load,
    OutputBatch,
    TokenOutput,
    TransferRecord,
)

HEARTBEAT_SECONDS = 1.0


class Transport(Protocol):
    async def receive(self, timeout: float | None) -> list[InboundMessage]:
        """Every message that arrived; with a timeout, wait up to it for the first.
        Returns None-free lists; raises ConnectionError once the frontend is gone."""
        ...

    def send(self, batch: OutputBatch) -> None: ...

    async def close(self) -> None: ...


class LoadReporter:
    """Sends the load with every output batch; a changed load even without outputs
    (a cancelled request ends without a token); an unchanged idle load at most once
    a second, as a heartbeat the frontend tells a live engine from a stale one by. It
    also counts the planned rounds by their token count (the iteration histogram)."""

    def __init__(self, replica: int = 0) -> None:
        self.replica = replica
        self._last: Load | None = None
        self._last_sent = 0.0
        self._buckets = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)

    def planned(self, num_tokens: int) -> None:
        """A round's plan forwards ``num_tokens`` (0: no batch, not a round the load's
        counters count)."""
        if num_tokens:
            self._buckets[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1

    def batch(
        self,
        outputs: list[TokenOutput],
        load: Load,
        jit: tuple[int, float] = (0, 0.0),
        replies: list[ControlReply] | None = None,
        pd: tuple[int, int, int] = (0, 0, 0),
        transfers: list[TransferRecord] | None = None,
    ) -> OutputBatch | None:
        """``pd``: transfers in flight, unclaimed rooms, quarantined pages; ``transfers``:
        the PD transfers that ended this round (sent even when nothing else changed)."""
        load = msgspec.structs.replace(
            load,
            jit_compiles=jit[0],
            jit_compile_seconds=jit[1],
            pd_in_flight=pd[0],
            pd_unclaimed_rooms=pd[1],
            pd_quarantined_pages=pd[2],
            iteration_buckets=tuple(self._buckets),
        )
        now = time.monotonic()
        # The iteration counters move every forward; alone they are not news.
        state = msgspec.structs.replace(
            load, forward_rounds=0, forward_tokens=0, iteration_buckets=()
        )
        if (
            not outputs
            and not replies
            and not transfers
            and state == self._last
            and now - self._last_sent < HEARTBEAT_SECONDS
        ):
            return None
        self._last = state
        self._last_sent = now
        return OutputBatch(outputs, load, self.replica, replies or [], transfers or [])


class LocalTransport:
    """In-process wire: the frontend puts messages, the loop drains them each round;
    outputs go to a queue the frontend's single output task consumes."""

    def __init__(self) -> None:
        self._inbox: list[InboundMessage] = []
        self._arrived = asyncio.Event()
        self.outputs: asyncio.Queue[OutputBatch] = asyncio.Queue()
        self._closed = False

    def put(self, msg: InboundMessage) -> None:
        self._inbox.append(msg)
        self._arrived.set()

    async def receive(self, timeout: float | None) -> list[InboundMessage]:
        if not self._inbox and timeout:
            # A timeout is an idle round: the caller sends its heartbeat.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout)
        if self._closed and not self._inbox:
            raise ConnectionError("the frontend closed the in-process transport")
        msgs, self._inbox = self._inbox, []
        self._arrived.clear()
        return msgs

    def send(self, batch: OutputBatch) -> None:
        self.outputs.put_nowait(batch)

    async def close(self) -> None:
        self._closed = True
        self._arrived.set()
