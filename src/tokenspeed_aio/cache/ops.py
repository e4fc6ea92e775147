"""The plan's cache ops as the data plane submits them: adapted once, on the forward
thread, into immutable tuples in submission order (``cache_ops_from_plan``), which
``DeviceHandle.execute`` consumes. The control plane counts its open ops from the same
plan, so what is counted is what is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenspeed_aio.scheduler.cache_ops import LoadBackOp, RestoreOp, SnapshotOp, WriteBackOp
from tokenspeed_aio.scheduler.plan import ExecutionPlan


@dataclass(frozen=True, slots=True)
class DeviceCacheOps:
    """One plan's cache ops, grouped by where they go in the submission order."""

    # Host-bound stores that must read pages this plan may re-grant: a retraction image's
    # two legs (its write-back and its snapshot store) and what the plan's allocations
    # evicted (write_back). One write-stream event fences the forward stream behind them.
    ordered_stores: tuple[WriteBackOp | SnapshotOp, ...] = ()
    # Host-bound stores whose sources the scheduler pinned (write_through): no fence.
    stores: tuple[WriteBackOp, ...] = ()
    # Device-bound: load-backs (the batch reads them behind per-layer fences), then
    # restores (one event each; their requests are unschedulable until the ACK).
    loads: tuple[LoadBackOp, ...] = ()
    restores: tuple[RestoreOp, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.ordered_stores or self.stores or self.loads or self.restores)

    @property
    def num_ops(self) -> int:
        return len(self.ordered_stores) + len(self.stores) + len(self.loads) + len(self.restores)


NO_CACHE_OPS = DeviceCacheOps()


def cache_ops_from_plan(plan: ExecutionPlan) -> DeviceCacheOps:
    cache = plan.cache
    if cache is None:
        return NO_CACHE_OPS
    ordered = tuple(op for op in cache.write_backs if op.stream_ordered)
    return DeviceCacheOps(
        ordered_stores=(*ordered, *cache.snapshots),
        stores=tuple(op for op in cache.write_backs if not op.stream_ordered),
        loads=tuple(cache.loads),
        restores=tuple(cache.restores),
    )
