"""The replica's relay: its first member owns the frontend connection and hands each
round's messages to every member in one exchange, so all members admit the same
requests in the same round. Only the first member sends outputs.

With a replica of one (no group), the relay is the transport itself.
"""

from __future__ import annotations

from typing import Protocol

from tokenspeed_aio.control.transport import HEARTBEAT_SECONDS, Transport
from tokenspeed_aio.wire.messages import InboundMessage, OutputBatch


class ReplicaGroup(Protocol):
    """The collective group of the replica's members (collective/)."""

    rank_in_group: int

    async def broadcast(self, obj: object, root: int = 0) -> object: ...


class Relay:
    def __init__(self, transport: Transport | None, group: ReplicaGroup | None = None) -> None:
        self.transport = transport  # only the first member holds one
        self.group = group
        self.is_owner = group is None or group.rank_in_group == 0
        if self.is_owner and transport is None:
            raise ValueError("the replica's first member needs the frontend transport")

    async def receive(self, wait: bool) -> list[InboundMessage]:
        """This round's messages (waiting up to a heartbeat only when the engine is idle).
        A closed frontend surfaces as ConnectionError on the owner, and as a StopEngine
        on the members, so every member stops after the same round."""
        if self.group is None:
            return await self.transport.receive(HEARTBEAT_SECONDS if wait else None)
        messages: list[InboundMessage] | None = None
        if self.is_owner:
            messages = await self.transport.receive(HEARTBEAT_SECONDS if wait else None)
        return await self.group.broadcast(messages, root=0)

    def send(self, batch: OutputBatch) -> None:
        if self.is_owner:
            self.transport.send(batch)
