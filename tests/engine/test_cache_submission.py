"""DeviceHandle.execute's submission order, on the real device side (CPU): host-bound
stores, then device-to-device copies, then zeroing, then loads and restores, then the
batch. Each step reads what the one before left, so the order shows in the bytes: a store
reads a block's old bytes although the same plan copies over it, a copy reads a block the
same plan zeroes, a load lands on a block the same plan zeroes."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.cache.ops import cache_ops_from_plan
from tokenspeed_aio.data_plane.device import build_device_side
from tokenspeed_aio.data_plane.specs import RankInfo
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.cache_ops import (
    CachePlan,
    LoadBackOp,
    RestoreOp,
    SnapshotOp,
    WriteBackOp,
)
from tokenspeed_aio.scheduler.plan import ExecutionPlan, NewSlotOwner, ScheduledRow


@pytest.fixture(scope="module")
def handle(ckpt):
    args = EngineArgs(
        model=str(ckpt("llama")),
        device="cpu",
        page_size=4,
        num_kv_blocks=16,
        max_num_seqs=4,
        max_model_len=64,
        kvstore_ratio=2.0,
    )
    build = build_device_side(args, RankInfo())
    yield build.handle
    build.handle.shutdown()


def fill(t: torch.Tensor, value: float) -> None:
    t.fill_(value)


def test_each_step_reads_what_the_one_before_left(handle):
    cache = handle._cache
    kv, host = cache.pool(), cache.host_pages
    fill(kv[:, :, 5], 5.0)
    fill(kv[:, :, 6], 6.0)
    fill(host[1], 11.0)
    plan = ExecutionPlan(
        plan_id=0,
        cache=CachePlan(
            write_backs=[
                WriteBackOp(1, (5,), (0,), True, "retraction"),
                WriteBackOp(2, (6,), (2,), False, "write_through"),
            ],
            loads=[LoadBackOp(3, "r", (1,), (7,))],
        ),
        pages_to_copy=((6, 5),),
        pages_to_zero=(6, 7),
    )
    # A batch of its own: a prompt in block 9, which no cache op touches.
    owner = NewSlotOwner(SamplingParams(max_tokens=1, temperature=0.0), 0, [5, 6, 7], [])
    plan.rows = [ScheduledRow("x", 3, 0, 3, [5, 6, 7], (9,), 0, True, 0, owner)]
    calls = []
    for name in ("store", "copy_blocks", "zero_blocks", "load", "joined"):
        original = getattr(cache, name)

        def logged(*a, _name=name, _original=original):
            calls.append(_name)
            return _original(*a)

        setattr(cache, name, logged)
    runner_execute = handle._runner.execute
    handle._runner.execute = lambda *a: calls.append("batch") or runner_execute(*a)
    try:
        handle.execute(plan, cache_ops_from_plan(plan))
    finally:
        for name in ("store", "copy_blocks", "zero_blocks", "load", "joined"):
            delattr(cache, name)
        handle._runner.execute = runner_execute
    assert calls == ["store", "copy_blocks", "zero_blocks", "load", "batch", "joined"]
    assert torch.all(host[0] == 5.0)  # the store read block 5 before the copy overwrote it
    assert torch.all(host[2] == 6.0)  # ... and block 6 before the zeroing
    assert torch.all(kv[:, :, 5] == 6.0)  # the copy read block 6 before the zeroing
    assert torch.all(kv[:, :, 6] == 0.0)
    assert torch.all(kv[:, :, 7] == 11.0)  # the load landed after the zeroing
    results = handle.poll_cache_results()
    assert sorted(results.acks) == [1, 2, 3] and results.landed == 3
    assert handle.poll_cache_results().acks == []  # each ACK once


def test_snapshot_then_restore_moves_a_slot_and_its_pages(handle):
    cache = handle._cache
    kv, runner = cache.pool(), handle._runner
    fill(kv[:, :, 3], 3.0)
    fill(kv[:, :, 4], 4.0)
    runner.last_sampled[1] = 42
    store = ExecutionPlan(
        plan_id=1,
        cache=CachePlan(
            write_backs=[WriteBackOp(10, (3,), (5,), True, "retraction")],
            snapshots=[SnapshotOp(11, "r", 1, (4,), (0,), 0)],
        ),
        pages_to_zero=(3, 4),  # re-granted and sanitized by the same plan
    )
    handle.execute(store, cache_ops_from_plan(store))
    assert sorted(handle.poll_cache_results().acks) == [10, 11]
    runner.last_sampled[1] = 7  # the slot's next owner
    restore = ExecutionPlan(
        plan_id=2,
        cache=CachePlan(restores=[RestoreOp(12, "r", 2, (5,), (0,), (8, 9), 0)]),
    )
    handle.execute(restore, cache_ops_from_plan(restore))
    assert handle.poll_cache_results().acks == [12]
    assert torch.all(kv[:, :, 8] == 3.0) and torch.all(kv[:, :, 9] == 4.0)
    assert int(runner.last_sampled[2]) == 42  # the future token moved to the new slot
