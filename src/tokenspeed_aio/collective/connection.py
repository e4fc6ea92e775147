"""A TCP connection that carries length-prefixed frames, read by callbacks instead of a task."""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable

import msgspec

from tokenspeed_aio.collective.framing import HEADER, MAX_FRAME_BYTES

Receiver = Callable[[bytes], None]


class FrameConnection(asyncio.Protocol):
    """One end of a mesh, rendezvous or handshake connection.

    The event loop hands arriving bytes to ``data_received``, which splits them into frames
    and gives each to the receiver set with ``receive`` — in the loop's own callback, so a
    frame reaches the call waiting on it without a reader task's extra loop hop. With no
    receiver, frames are held: a handshake takes them one at a time (``next_frame``) and the
    receiver set afterwards gets those that arrived meanwhile, in order.

    When the connection ends (EOF, an error, an unreadable frame, or ``close``), ``lost`` says
    why and ``on_lost`` runs; an exception a receiver raises ends the connection the same way.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost: str | None = None
        self.on_lost: Callable[[], None] | None = None
        self._buffer = bytearray()
        self._held: deque[bytes] = deque()
        self._receiver: Receiver | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Closed by its owner between the factory call and connection_made.
        self._close_when_made = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP transport (or uvloop's)
        if self._close_when_made:
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Round messages are small and latency-bound: never hold one back (Nagle).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        try:
            while len(buffer) - start >= HEADER.size:
                (length,) = HEADER.unpack_from(buffer, start)
                if length > MAX_FRAME_BYTES:
                    self._abort(f"sent a frame of {length} bytes (over {MAX_FRAME_BYTES})")
                    return
                end = start + HEADER.size + length
                if end > len(buffer):
                    break
                frame = bytes(buffer[start + HEADER.size : end])
                start = end
                receiver = self._receiver
                if receiver is not None:
                    receiver(frame)
                else:
                    self._held.append(frame)
                    self._wake()
        except msgspec.DecodeError as exc:
            self._abort(f"sent an unreadable frame ({exc})")
        finally:
            del buffer[:start]

    def eof_received(self) -> None:
        self.lost = self.lost or (
            "closed its connection mid-frame" if self._buffer else "closed its connection (EOF)"
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = f"connection failed ({exc!r})" if exc else "closed its connection"
        self._wake()
        if self.on_lost is not None:
            self.on_lost()
        self._closed.set_result(None)

    def receive(self, receiver: Receiver | None) -> None:
        """Deliver frames to ``receiver`` from now on (the held ones first); None holds them."""
        self._receiver = receiver
        while receiver is not None and self._held and self._receiver is receiver:
            receiver(self._held.popleft())

    async def next_frame(self) -> bytes:
        """The next held frame (handshakes; bound it with a timeout). Raises ConnectionError."""
        while not self._held:
            if self.lost is not None:
                raise ConnectionError(self.lost)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._held.popleft()

    def send(self, frame: bytearray) -> None:
        # The transport sends at once when the socket has room and buffers the rest; round
        # messages are small, so there is no backpressure to wait for on this path.
        assert self.transport is not None
        self.transport.write(frame)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _abort(self, why: str) -> None:
        self.lost = self.lost or why
        assert self.transport is not None
        self.transport.abort()

    def close_soon(self) -> None:
        """Close after the queued frames are sent (a rejection, a roster)."""
        self.lost = self.lost or "connection closed by this rank"
        assert self.transport is not None
        self.transport.close()

    async def close(self) -> None:
        """Close now and wait until the connection is down."""
        if self.transport is None:
            # Accepted but not yet made (the loop calls connection_made next); it closes then.
            self._close_when_made = True
            return
        if not self._closed.done():
            self.lost = self.lost or "connection closed by this rank"
            if self.transport.get_write_buffer_size():
                # Unsent bytes mean the peer stopped reading; a graceful close would wait on it.
                self.transport.abort()
            else:
                self.transport.close()
        await asyncio.shield(self._closed)


async def open_connection(host: str, port: int) -> FrameConnection:
    """Dial ``host:port`` (raises OSError when nothing listens there)."""
    _, protocol = await asyncio.get_running_loop().create_connection(FrameConnection, host, port)
    return protocol
