"""The data plane: one forward thread per rank, the only code that touches the device.

Operations are queued FIFO (``queue.SimpleQueue``) and run one at a time. Submitting
a forward returns a PendingExecution at once; the forward thread resolves its
``launched`` future once the kernels are enqueued, and its ``landed`` future is
resolved with the plain-Python result once the result copies arrived: by the
landing thread after waiting on the forward's CUDA event (which releases the GIL),
or on CPU by the forward thread itself. Futures are resolved on the control
plane's loop through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
from typing import Any, Protocol

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.cache.ops import DeviceCacheOps, cache_ops_from_plan
from tokenspeed_aio.control.cache_ops import CacheResults
from tokenspeed_aio.control.data_plane import PendingExecution
from tokenspeed_aio.control.storage import StorageReport
from tokenspeed_aio.data_plane.gc_hooks import GcHooks
from tokenspeed_aio.data_plane.specs import DeviceSpecs, RankInfo
from tokenspeed_aio.errors import EngineError
from tokenspeed_aio.scheduler.plan import ExecutionPlan, ForwardResult

logger = logging.getLogger(__name__)

# The control loop and the forward thread share the GIL. A thread that wakes (a landed
# forward, a queued plan) waits for the running one to reach the switch interval, 5 ms
# by default: several such waits per round made in-process serving ~5x slower
# (docs/design/gil-switch-interval.md). 0.5 ms keeps handoffs short.
GIL_SWITCH_INTERVAL = 0.0005


class Landable(Protocol):
    """A launched forward as the landing thread sees it (data_plane/landing.py's
    LaunchedForward): an event to wait on, then plain results to collect."""

    event: Any  # torch.cuda.Event recorded after the result copies, or None on CPU

    def collect(self) -> ForwardResult:
        """Read the landed host copies into plain Python (after ``event`` completed)."""
        ...


class Handle(Protocol):
    def enter_serving(self) -> None: ...

    def execute(self, plan: ExecutionPlan, cache_ops: DeviceCacheOps) -> Landable: ...

    def poll_cache_results(self) -> CacheResults: ...

    def idle_forward(self) -> None: ...

    def forward_timeline(self) -> dict[str, float] | None: ...

    def shutdown(self) -> None: ...


def _resolve(fut: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class _Stop:
    """Queue sentinel: the thread exits after running everything queued before it."""


class ForwardThreadDataPlane:
    """Implements control.data_plane.DataPlane over a forward thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, name: str = "ts-forward") -> None:
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL)
        self._loop = loop
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._landing: queue.SimpleQueue = queue.SimpleQueue()
        self._handle: Handle | None = None
        self.gc_hooks = GcHooks()
        self._thread = threading.Thread(target=self._forward_main, name=name, daemon=True)
        self._landing_thread = threading.Thread(
            target=self._landing_main, name=f"{name}-landing", daemon=True
        )
        self._thread.start()
        self._landing_thread.start()

    # -- control-plane side ---------------------------------------------------
    async def build(self, args: EngineArgs, rank: RankInfo) -> tuple[DeviceSpecs, Any]:
        """Build the device side on the forward thread (every device object is created
        and owned there); the plain DeviceSpecs come back, and the PD transfer peer's
        control face (None for a plain engine)."""
        fut = self._loop.create_future()
        self._ops.put((self._build, (args, rank), fut))
        return await fut

    async def enter_serving(self) -> None:
        """Startup is over: from here the data plane's per-round path may not sync with
        the device or compile kernels (both are reported, or raised)."""
        await self._ask("enter_serving")

    async def forward_timeline(self) -> dict[str, float] | None:
        """Profiling: device busy/idle milliseconds since the last call (None on CPU)."""
        return await self._ask("forward_timeline")

    async def _ask(self, operation: str, *args: Any):
        """A low-rate DeviceHandle operation whose answer the caller needs, queued
        behind the forwards already submitted."""
        fut = self._loop.create_future()
        self._ops.put((self._named, (operation, args), fut))
        return await fut

    def execute(self, plan: ExecutionPlan) -> PendingExecution:
        pending = PendingExecution(plan.plan_id, self._loop)
        self._ops.put((self._execute, plan, pending))
        return pending

    def poll_cache_results(self) -> CacheResults:
        """The completion query runs here, on the control thread: queued, it would wait
        behind every forward still being launched. It only reads what landed."""
        return self._handle.poll_cache_results()

    def submit_storage(self, ops: list) -> None:
        """The L3 executor is host-only: the control thread hands it the ops itself."""
        self._handle.storage.submit(ops)

    def poll_storage(self) -> StorageReport:
        return self._handle.storage.poll()

    async def delete_storage(self) -> None:
        storage = self._handle.storage
        if storage is not None:  # a blocking store call: off the control thread
            await asyncio.to_thread(storage.delete_namespace)

    async def idle_forward(self) -> None:
        await self._ask("idle_forward")

    # -- control operations (control/control.py), each awaited -----------------------------
    async def release_memory(self, tags: list[str]) -> None:
        await self._ask("release_memory", tags)

    async def resume_memory(self, tags: list[str]) -> None:
        await self._ask("resume_memory", tags)

    async def stage_weights(self, update: object) -> str | None:
        return await self._ask("stage_weights", update)

    async def load_staged_weights(self) -> str | None:
        return await self._ask("load_staged_weights")

    async def commit_weights(self, ok: bool | None) -> None:
        await self._ask("commit_weights", ok)

    async def init_weights_group(self, op: object) -> None:
        await self._ask("init_weights_group", op)

    async def destroy_weights_group(self, group_name: str) -> None:
        await self._ask("destroy_weights_group", group_name)

    async def start_profile(self, op: object) -> None:
        await self._ask("start_profile", op)

    async def stop_profile(self) -> str:
        return await self._ask("stop_profile")

    async def shutdown(self) -> None:
        fut = self._loop.create_future()
        self._ops.put((self._stop, None, fut))
        await fut
        self._landing.put(None)
        await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self._landing_thread.join)

    # -- forward thread -----------------------------------------------------------
    def _forward_main(self) -> None:
        while True:
            op, arg, fut = self._ops.get()
            try:
                if op(arg, fut) is _Stop:
                    return
            except BaseException as err:  # a failed op fails its caller, not the thread
                if isinstance(err, EngineError):  # a refusal the caller answers with
                    logger.info("data-plane operation refused: %s", err)
                else:
                    logger.exception("data-plane operation %s failed", op.__name__)
                futures = (
                    (fut.launched, fut.landed) if isinstance(fut, PendingExecution) else (fut,)
                )
                for f in futures:
                    self._loop.call_soon_threadsafe(_resolve, f, None, err)

    def _build(self, args: tuple[EngineArgs, RankInfo], fut: asyncio.Future) -> None:
        from tokenspeed_aio.data_plane.device import build_device_side
        from tokenspeed_aio.guards.host_sync import allow_host_sync

        # Startup waits on the device by design; another engine of this process may be
        # serving with the (process-wide) sync-debug mode armed.
        with allow_host_sync():
            device_build = build_device_side(*args)
        self._handle = device_build.handle
        result = (device_build.specs, device_build.transfer)
        self._loop.call_soon_threadsafe(_resolve, fut, result)

    def _named(self, call: tuple[str, tuple], fut: asyncio.Future) -> None:
        operation, args = call
        if operation == "idle_forward":  # idle forwards count: GC rounds stay rank-identical
            self.gc_hooks.forwarded()
        result = getattr(self._handle, operation)(*args)
        self._loop.call_soon_threadsafe(_resolve, fut, result)

    def _execute(self, plan: ExecutionPlan, pending: PendingExecution) -> None:
        # The plan's cache ops, adapted once into the immutable tuples execute consumes.
        launched = self._handle.execute(plan, cache_ops_from_plan(plan))
        self._loop.call_soon_threadsafe(_resolve, pending.launched)
        self.gc_hooks.forwarded()
        if launched.event is None:
            self._loop.call_soon_threadsafe(_resolve, pending.landed, launched.collect())
        else:
            self._landing.put((launched, pending))

    def _stop(self, _: None, fut: asyncio.Future) -> type[_Stop]:
        if self._handle is not None:
            self._handle.shutdown()
            self._handle = None
        self._loop.call_soon_threadsafe(_resolve, fut)
        return _Stop

    # -- landing thread -------------------------------------------------------------
    def _landing_main(self) -> None:
        while (item := self._landing.get()) is not None:
            launched, pending = item
            try:
                launched.event.synchronize()  # releases the GIL while it waits
                result = launched.collect()
            except BaseException as err:
                logger.exception("landing of forward %d failed", pending.plan_id)
                self._loop.call_soon_threadsafe(_resolve, pending.landed, None, err)
            else:
                self._loop.call_soon_threadsafe(_resolve, pending.landed, result)
