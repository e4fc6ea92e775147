"""The engine side of the frontend wire over ZMQ (the replica's first member).

    frontend ROUTER  <── DEALER (identity replica-N): registration, then inbound messages
    frontend PULL    <── PUSH: output batches

The DEALER never reconnects: a frontend that is gone (connection closed, or the
parent process exited) surfaces as ConnectionError from ``receive``, which stops
every rank of the replica after the same round.
"""

from __future__ import annotations

import asyncio
import logging
import os

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from tokenspeed_aio.wire.codec import decode_handshake, decode_inbound, encode
from tokenspeed_aio.wire.messages import (
    EngineRegistration,
    InboundMessage,
    OutputBatch,
    RegistrationReply,
)

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 60.0


class ZmqTransport:
    def __init__(self, input_addr: str, output_addr: str, replica: int) -> None:
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.DEALER)
        self._input.setsockopt(zmq.IDENTITY, f"replica-{replica}".encode())
        self._input.setsockopt(zmq.RECONNECT_IVL, -1)  # a closed frontend stays closed
        self._input.setsockopt(zmq.LINGER, 0)
        self._monitor = self._input.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._input.connect(input_addr)
        self._output = self._ctx.socket(zmq.PUSH)
        self._output.setsockopt(zmq.LINGER, 1000)
        self._output.connect(output_addr)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._input, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._parent = os.getppid()

    async def register(self, registration: EngineRegistration) -> None:
        await self._input.send(encode(registration))
        if not await self._input.poll(HANDSHAKE_TIMEOUT * 1000):
            raise ConnectionError(
                f"the frontend did not answer the handshake in {HANDSHAKE_TIMEOUT} s"
            )
        reply = decode_handshake(await self._input.recv())
        if not isinstance(reply, RegistrationReply) or not reply.accepted:
            raise ConnectionError(f"the frontend refused this engine: {reply.reason}")

    async def receive(self, timeout: float | None) -> list[InboundMessage]:
        messages = self._drain()
        if messages or not timeout:
            self._check_frontend()
            return messages
        events = dict(await self._poller.poll(timeout * 1000))
        if self._monitor in events:
            event = await recv_monitor_message(self._monitor)
            raise ConnectionError(f"the frontend connection closed ({event['event']!r})")
        self._check_frontend()
        return self._drain()

    def _drain(self) -> list[InboundMessage]:
        """Everything already queued, without waiting (a NOBLOCK recv resolves at once);
        a frame carries the messages of one event-loop turn of the frontend."""
        messages: list[InboundMessage] = []
        while True:
            fut = self._input.recv(zmq.NOBLOCK)
            error = fut.exception()
            if isinstance(error, zmq.Again):
                return messages
            if error is not None:
                raise error
            messages += decode_inbound(fut.result())

    def _check_frontend(self) -> None:
        if os.getppid() != self._parent:
            raise ConnectionError("the frontend process exited")
        if self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            raise ConnectionError("the frontend connection closed")

    def send(self, batch: OutputBatch) -> None:
        # Fire-and-forget: a PUSH send only queues; a full queue parks it on the loop.
        fut = self._output.send(encode(batch), copy=False)
        fut.add_done_callback(_log_send_failure)

    async def close(self) -> None:
        self._input.disable_monitor()
        self._ctx.destroy(linger=1000)


def _log_send_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.error("sending outputs to the frontend failed: %r", fut.exception())
