"""One peer's link: its connection, demultiplexed into per-group inboxes."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from tokenspeed_aio.collective.connection import FrameConnection
from tokenspeed_aio.collective.framing import ENVELOPE_DECODER, Envelope


class Inbox:
    """The frames one peer sent for one group, in arrival order, and the call waiting on them.

    A group runs one call at a time, so at most one future waits here; it is woken with
    ``True`` when a frame arrives (and by the group itself on a loss or a timeout).
    """

    __slots__ = ("frames", "waiter")

    def __init__(self) -> None:
        self.frames: deque[Envelope] = deque()
        self.waiter: asyncio.Future[bool] | None = None

    def put(self, frame: Envelope) -> None:
        self.frames.append(frame)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)


class PeerLink:
    """The one full-duplex connection to a peer rank, after its handshake.

    Every frame the peer sends is decoded in the connection's callback and put in its group's
    inbox. When the connection ends, ``lost`` says why and ``on_lost(rank)`` runs, which wakes
    any call waiting on this peer, so a closed peer is seen at once, not at a timeout.
    """

    def __init__(self, rank: int, connection: FrameConnection, on_lost: Callable[[int], None]):
        self.rank = rank
        self._connection = connection
        self._inboxes: dict[tuple[int, ...], Inbox] = {}
        connection.on_lost = lambda: on_lost(rank)
        connection.receive(self._receive)

    @property
    def lost(self) -> str | None:
        return self._connection.lost

    def inbox(self, group: tuple[int, ...]) -> Inbox:
        """The inbox of ``group``'s frames; a peer may send for a group before it exists here."""
        box = self._inboxes.get(group)
        if box is None:
            box = self._inboxes[group] = Inbox()
        return box

    def _receive(self, body: bytes) -> None:
        frame = ENVELOPE_DECODER.decode(body)
        box = self._inboxes.get(frame.group)
        (box if box is not None else self.inbox(frame.group)).put(frame)

    def send(self, frame: bytearray) -> None:
        self._connection.send(frame)

    async def close(self) -> None:
        await self._connection.close()
