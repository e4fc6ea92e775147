"""The decode rank's records: one request's room (its prefill engine, its landing pages,
the state of its transfer) and the control connection to one prefill rank."""

from __future__ import annotations

import asyncio
import time

from tokenspeed_aio.pd.framing import write_frame
from tokenspeed_aio.pd.messages import RankEndpoint
from tokenspeed_aio.wire.messages import Bootstrap

REGISTERED, CLAIMED, QUARANTINED = "registered", "claimed", "quarantined"


class DecodeRoom:
    """One request's room: where its prefill engine is, its landing pages, and how far
    its transfer got."""

    __slots__ = (
        "cancelled",
        "claimed",
        "created",
        "failed",
        "link",
        "pages",
        "rid",
        "room",
        "state",
        "where",
    )

    def __init__(self, rid: str, bootstrap: Bootstrap) -> None:
        self.rid = rid
        self.room = bootstrap.room
        self.where = (bootstrap.host, bootstrap.port)
        self.state = REGISTERED
        self.link: PrefillLink | None = None
        self.pages: list[int] | None = None  # landing pages, once the plan staged them
        self.created = time.monotonic()
        self.claimed = 0.0  # when the Claim went out
        self.cancelled = False  # a Cancel went out: waiting for its acknowledgment
        self.failed = False  # its FAILED was reported


class PrefillLink:
    """The control connection of this decode rank to one prefill rank."""

    def __init__(self, endpoint: RankEndpoint, where: tuple[str, int]) -> None:
        self.endpoint = endpoint
        self.where = where  # the bootstrap server it was found at
        self.writer: asyncio.StreamWriter | None = None
        self.rooms: dict[int, DecodeRoom] = {}
        self.alive = False

    @property
    def name(self) -> str:
        return f"{self.endpoint.host}:{self.endpoint.port} (rank {self.endpoint.tp_rank})"

    def send(self, message) -> None:
        if self.alive:
            write_frame(self.writer, message)
