"""The control plane's only way to the device: the DataPlane interface.

Every operation that issues or orders device work is queued to the data plane's
forward thread. ``execute`` returns at once with a PendingExecution whose two
futures (on the control plane's loop) resolve when the forward was launched and
when its results landed on the host. Only ``await pending.result()`` (the commit)
waits; dispatch never does.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from tokenspeed_aio.scheduler.plan import ExecutionPlan, ForwardResult


class PendingExecution:
    """A dispatched forward: ``launched`` then ``landed`` (valued with its ForwardResult)."""

    __slots__ = ("landed", "launched", "plan_id")

    def __init__(self, plan_id: int, loop: asyncio.AbstractEventLoop) -> None:
        self.plan_id = plan_id
        self.launched: asyncio.Future[None] = loop.create_future()
        self.landed: asyncio.Future[ForwardResult] = loop.create_future()

    async def result(self) -> ForwardResult:
        await self.launched
        return await self.landed


class DataPlane(Protocol):
    """What the event loop may ask of the device side. Nothing else crosses."""

    def execute(self, plan: ExecutionPlan) -> PendingExecution:
        """Queue the plan's forward; never blocks."""
        ...

    async def idle_forward(self) -> None:
        """Attention DP: a forward with no tokens, so this rank joins the forward-time
        collectives a peer's real forward enters. Awaited: the round needs it done."""
        ...

    async def shutdown(self) -> None: ...
