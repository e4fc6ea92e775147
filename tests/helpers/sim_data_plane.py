"""A torch-free ``control.data_plane.DataPlane`` over the model-free SimDevice.

``execute`` returns at once, as the forward thread's does. The forward itself runs
later, in dispatch order, from a callback of the control plane's loop; a second
callback lands its result. So at in-flight depth 1 a dispatch really overlaps the
previous forward's commit: the commit awaits a future that is not resolved yet.

The capture contract is checked on every forward: the plan it runs equals the plan as
dispatched (no list in it is the scheduler's live state, mutated meanwhile).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import msgspec

from helpers.sim_device import SimDevice
from tokenspeed_aio.control.cache_ops import CacheResults
from tokenspeed_aio.control.data_plane import PendingExecution
from tokenspeed_aio.scheduler.plan import ExecutionPlan, ForwardResult

_encode = msgspec.msgpack.Encoder().encode


class SimForwardError(RuntimeError):
    """The forward a test asked to fail (``fail_plan``)."""


def _frozen(plan: ExecutionPlan) -> tuple:
    """A copy of what a launched forward reads, every list as a tuple (a grammar matcher
    by identity: the commit advances it by design)."""
    rows = []
    for row in plan.rows:
        owner = row.new_owner
        if owner is not None:
            owner = (
                _encode(owner.params),
                owner.seed,
                tuple(owner.prompt_token_ids),
                tuple(owner.output_token_ids),
            )
        values = row._replace(new_owner=owner, grammar=id(row.grammar))
        rows.append(tuple(tuple(v) if isinstance(v, list) else v for v in values))
    return plan.plan_id, rows


class SimDataPlane:
    def __init__(
        self,
        device: SimDevice,
        *,
        on_execute: Callable[[ExecutionPlan], None] | None = None,
        fail_plan: int | None = None,
        storage=None,
    ) -> None:
        self.device = device
        self.storage = storage  # the L3 executor (helpers/sim_store.py), or None
        self.on_execute = on_execute  # a test's check of each plan as it is dispatched
        self.fail_plan = fail_plan  # plan id whose forward raises SimForwardError
        self.plans: list[ExecutionPlan] = []  # every dispatched plan, in order
        self.num_idle_forwards = 0
        self.num_landed = 0  # cache ops acknowledged
        self.num_storage_deletes = 0
        self.closed = False
        self._queued: deque[tuple[ExecutionPlan, tuple, PendingExecution]] = deque()

    def execute(self, plan: ExecutionPlan) -> PendingExecution:
        assert not self.closed, "execute after shutdown"
        if self.on_execute is not None:
            self.on_execute(plan)
        loop = asyncio.get_running_loop()
        pending = PendingExecution(plan.plan_id, loop)
        self.plans.append(plan)
        self._queued.append((plan, _frozen(plan), pending))
        loop.call_soon(self._launch_oldest)
        return pending

    def _launch_oldest(self) -> None:
        """One forward, the oldest queued (the forward thread's FIFO)."""
        plan, frozen, pending = self._queued.popleft()
        try:
            assert _frozen(plan) == frozen, f"plan {plan.plan_id} changed after its dispatch"
            if plan.plan_id == self.fail_plan:
                raise SimForwardError(f"injected failure of forward {plan.plan_id}")
            result: ForwardResult = self.device.execute(plan)
        except BaseException as err:  # the commit raises it, as a failed forward's
            for fut in (pending.launched, pending.landed):
                fut.set_exception(err)
                fut.exception()  # unawaited (the loop stopped first), it is not logged
            return
        pending.launched.set_result(None)
        asyncio.get_running_loop().call_soon(pending.landed.set_result, result)

    @property
    def num_queued(self) -> int:
        """Dispatched forwards that have not run yet."""
        return len(self._queued)

    def poll_cache_results(self) -> CacheResults:
        """The completion query: the cache ops the device (with host pages) landed."""
        poll = getattr(self.device, "poll", None)
        acks = poll() if poll is not None else []
        self.num_landed += len(acks)
        return CacheResults(acks, self.num_landed)

    async def idle_forward(self) -> None:
        self.num_idle_forwards += 1

    def submit_storage(self, ops) -> None:
        self.storage.submit(ops)

    def poll_storage(self):
        return self.storage.poll()

    async def delete_storage(self) -> None:
        """flush_cache's L3 deletion: counted (no store here)."""
        self.num_storage_deletes += 1

    async def shutdown(self) -> None:
        assert not self._queued, f"shutdown with {len(self._queued)} forwards not run"
        self.closed = True
