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

from tokenspeed_aio.control.cache_ops import CacheResults
from tokenspeed_aio.control.storage import StorageReport
from tokenspeed_aio.scheduler.plan import ExecutionPlan, ForwardResult
from tokenspeed_aio.wire.control import InitWeightsGroup, StartProfile


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
        """Queue the plan: its cache ops and its forward; never blocks."""
        ...

    def poll_cache_results(self) -> CacheResults:
        """A completion query, called on the control thread itself (queued, it would wait
        behind every forward still being launched): the cache ops whose copies landed since
        the last call. Touches no stream; never blocks."""
        ...

    def submit_storage(self, ops: list) -> None:
        """L3: hand the plan's storage operations to the L3 executor (host worker threads;
        no device work, no wait). Called on the control thread, before ``execute``."""
        ...

    def poll_storage(self) -> StorageReport:
        """L3: the executor's report -- its clock, queue depth and the operations completed
        since the last call (each once). Called on the control thread; never blocks."""
        ...

    async def delete_storage(self) -> None:
        """flush_cache: delete this deployment's L3 namespace (nothing without L3)."""
        ...

    async def idle_forward(self) -> None:
        """Attention DP: a forward with no tokens, so this rank joins the forward-time
        collectives a peer's real forward enters. Awaited: the round needs it done."""
        ...

    async def shutdown(self) -> None: ...

    # -- the low-rate control operations (control/control.py), each awaited ----------
    async def release_memory(self, tags: list[str]) -> None:
        """Free these regions' device memory (the loop drained first)."""
        ...

    async def resume_memory(self, tags: list[str]) -> None: ...

    async def stage_weights(self, update: object) -> str | None:
        """Check a weight update's prerequisites on this rank and stage what it needs (a
        decoded payload, the tensors' checks): None when ready, else why not. Loads nothing."""
        ...

    async def load_staged_weights(self) -> str | None:
        """Load the staged update into the model: None, or the error (the weights may then
        be partly written: the caller invalidates them)."""
        ...

    async def commit_weights(self, ok: bool) -> None:
        """The replica-wide outcome of the load: usable, or invalid until restart."""
        ...

    async def init_weights_group(self, op: InitWeightsGroup) -> None: ...

    async def destroy_weights_group(self, group_name: str) -> None: ...

    async def start_profile(self, op: StartProfile) -> None: ...

    async def stop_profile(self) -> str:
        """Stop the profiler and write its trace; returns where it went."""
        ...
