"""The replica's relay: its first member owns the frontend connection and hands each
round's messages to every member in one exchange, so all members admit the same
requests in the same round. Only the first member sends outputs.

The exchange is an all-gather, so it also carries each member's rank-local error
from the previous round: every member then fails together with that message; and, with
the L3 storage tier, each member's storage executor report (``reports`` after the
exchange), so a round runs one exchange, not two. With a replica of one (no group), the
relay is the transport itself.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

import msgspec

from tokenspeed_aio.control.transport import Transport
from tokenspeed_aio.wire.messages import InboundMessage, OutputBatch, StopEngine

logger = logging.getLogger(__name__)
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[InboundMessage]).decode


class ReplicaGroup(Protocol):
    """The collective group of the replica's members (collective.Group)."""

    async def all_gather(
        self, value: object, *, error: str | None = None, timeout: float | None = None
    ) -> list: ...


class Relay:
    def __init__(
        self,
        transport: Transport | None,
        group: ReplicaGroup | None = None,
        *,
        is_owner: bool = True,
    ) -> None:
        self.transport = transport  # only the first member holds one
        self.group = group
        self.is_owner = is_owner
        self.reports: list = []  # every member's report of the last exchange, by member
        if is_owner and transport is None:
            raise ValueError("the replica's first member needs the frontend transport")

    async def receive(
        self, timeout: float | None, error: str | None = None, report: object = None
    ) -> list[InboundMessage]:
        """This round's messages, waiting up to ``timeout`` for the first (None: no wait).
        A frontend that is gone reads as a stop request, which every member receives in
        the same exchange, so all stop after the same round. ``report`` (this member's
        storage report) rides the same exchange; every member's lands in ``reports``."""
        messages = None
        if self.is_owner:
            try:
                messages = await self.transport.receive(timeout)
            except ConnectionError as err:
                logger.info("the frontend is gone (%s): stopping", err)
                messages = [StopEngine()]
        if self.group is None:
            self.reports = [report]
            return messages
        # The owner may idle up to a heartbeat before it joins: members wait for it.
        payload = _encode(messages) if self.is_owner else None
        shares = await self.group.all_gather([payload, report], error=error, timeout=math.inf)
        self.reports = [share[1] for share in shares]
        return _decode(next(s[0] for s in shares if s[0] is not None))

    def send(self, batch: OutputBatch) -> None:
        if self.is_owner:
            self.transport.send(batch)
