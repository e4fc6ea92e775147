"""The prefill rank's records: a decode rank's control connection, one room (this
engine's request for it and the decode rank's hold or claim), and whom the control
server lets in."""

from __future__ import annotations

import asyncio
import time

from tokenspeed_aio.pd.framing import write_frame
from tokenspeed_aio.pd.messages import CONTROL_VERSION, Hello, KvLayout
from tokenspeed_aio.scheduler.plan import RemoteDecode

WAITING, QUEUED, DONE = "waiting", "queued", "done"  # a room's write


class DecodeConnection:
    """A decode rank's control connection."""

    def __init__(self, writer: asyncio.StreamWriter, hello: Hello) -> None:
        self.writer = writer
        self.hello = hello
        self.rooms: set[int] = set()  # held or claimed through this connection
        self.alive = True
        self.serving = False  # it held, claimed or pinged: a decode rank's link
        self.reason = ""  # why it was taken for lost, beyond the connection closing

    def send(self, message) -> None:
        if self.alive:
            write_frame(self.writer, message)


class Room:
    """One room on this rank: the request's side and the decode rank's claim."""

    __slots__ = (
        "cancelled",
        "conn",
        "created",
        "failed",
        "pages",
        "peer_cancelled",
        "reason",
        "rid",
        "room",
        "state",
        "stream",
    )

    def __init__(self, room: int, rid: str | None) -> None:
        self.room = room
        self.rid = rid  # None until this engine's request for the room registered
        self.conn: DecodeConnection | None = None  # the decode rank that held or claimed it
        self.pages: list[int] | None = None  # its landing pages, once claimed
        self.stream: RemoteDecode | None = None  # the finished prompt, once planned
        self.state = WAITING
        self.created = time.monotonic()
        self.cancelled = False
        self.peer_cancelled = False  # the decode rank cancelled: it awaits a CancelAck
        self.failed = False
        self.reason = "the prefill request was cancelled"  # what the decode rank is told


def refusal(layout: KvLayout, tp_rank: int, hello: Hello) -> str | None:
    """Why this prefill rank refuses a decode rank's connection, or None."""
    if hello.version != CONTROL_VERSION:
        return (
            f"the decode engine speaks PD control protocol {hello.version}, this prefill "
            f"engine {CONTROL_VERSION}: run the same tokenspeed_aio version on both sides"
        )
    problem = layout.mismatch(hello.layout)
    if hello.tp_rank != tp_rank and problem is None:
        problem = f"decode rank {hello.tp_rank} dialed prefill rank {tp_rank}"
    return problem
