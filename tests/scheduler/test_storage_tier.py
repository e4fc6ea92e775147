"""The scheduler's L3 half alone: next_execution_plan() with made-up storage results,
asserting on the plan's storage ops, the preparing state, host block references and the
leak check; and the control plane's agreement of the members' reports."""

from __future__ import annotations

import pytest

from tokenspeed_aio.control.storage import StorageOps, StorageReport, StorageResult
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.cache_ops import CancelOp, GetOp, PutOp, QueryOp
from tokenspeed_aio.scheduler.plan import ExecutionPlan, ForwardCommitted, RequestFinished
from tokenspeed_aio.scheduler.request import Request, Status
from tokenspeed_aio.scheduler.scheduler import HostTierConfig, Scheduler, SchedulerConfig


def make(host_blocks: int = 32) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=32, page_size=4, max_num_seqs=4, max_num_batched_tokens=64,
            max_model_len=256, host=HostTierConfig(host_blocks, 8, 4), storage=True,
        )
    )  # fmt: skip


def submit(sched: Scheduler, rid: str, prompt: list[int]) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=2), seed=0, max_output=2)
    sched.submit([req])
    return req


def storage_ops(plan: ExecutionPlan) -> list:
    return list(plan.cache.storage) if plan.cache is not None else []


def ok(op, value: int = 0) -> StorageResult:
    return StorageResult(op.op_id, True, value)


def failed(op, error: str = "timed out") -> StorageResult:
    return StorageResult(op.op_id, False, 0, error)


def run_out(sched: Scheduler, plan: ExecutionPlan, *finished: str, store_up: bool = True) -> None:
    """Commit ``plan``, acknowledge its device cache ops, complete its PUTs."""
    tokens = [1] * len(plan.sample_rows)
    sched.advance([ForwardCommitted(plan.plan_id, tokens), *map(RequestFinished, finished)])
    acks = [op.op_id for op in plan.cache.ops()] if plan.cache else []
    puts = [ok(op, 1) for op in storage_ops(plan) if isinstance(op, PutOp)]
    sched.advance_head([], acks, puts, store_up)


def test_a_prepared_request_is_skipped_until_its_fetch_settles():
    sched = make()
    prompt = list(range(5, 18))  # 3 full blocks + 1 token
    a = submit(sched, "a", prompt)
    plan = sched.next_execution_plan()
    (query,) = storage_ops(plan)
    assert isinstance(query, QueryOp) and len(query.keys) == 3
    assert a.status is Status.PREPARING and not plan.rows and a not in sched.waiting
    hashed = list(a.block_hashes)
    plan = sched.next_execution_plan()  # a later round: a is not hashed or planned again
    assert not plan.rows and storage_ops(plan) == [] and a.block_hashes == hashed
    sched.advance_head([], [], [ok(query, 2)])  # the store holds its first 2 blocks
    plan = sched.next_execution_plan()
    (get,) = storage_ops(plan)
    assert isinstance(get, GetOp) and get.keys == query.keys[:2] and not plan.rows
    assert all(sched.host_tier.host.ref_count(b) == 1 for b in get.host_blocks)
    sched.advance_head([], [], [ok(get, 2 * 1024)])
    assert a.status is Status.WAITING and sched.waiting[0] is a
    plan = sched.next_execution_plan()
    (load,) = plan.cache.loads  # admitted with its 2 fetched pages as L2 hits
    assert load.src_blocks == get.host_blocks
    assert a.num_cached_tokens == 8 and plan.rows[0].num_tokens == 5
    assert sched.storage.stats.fetched_tokens == 8


def test_a_failed_query_or_fetch_recomputes():
    sched = make()
    a = submit(sched, "a", list(range(5, 18)))
    (query,) = storage_ops(sched.next_execution_plan())
    sched.advance_head([], [], [ok(query, 3)])
    (get,) = storage_ops(sched.next_execution_plan())
    sched.advance_head([], [], [failed(get)])  # timed out: its blocks are empty again
    assert sched.host_tier.host.num_active == 0
    plan = sched.next_execution_plan()
    assert plan.cache is None or not plan.cache.loads
    assert a.num_cached_tokens == 0 and plan.rows[0].num_tokens == 13  # computed in full
    b = submit(sched, "b", list(range(100, 113)))
    (query,) = storage_ops(sched.next_execution_plan())
    sched.advance_head([], [], [failed(query, "store unavailable")])
    assert b.status is Status.WAITING and b.storage_settled
    assert sched.storage.stats.recomputed_tokens == 12


@pytest.mark.parametrize("stage", ["query", "get", "fetched"])
def test_an_abort_while_preparing_finishes_at_the_next_head(stage):
    sched = make()
    submit(sched, "a", list(range(5, 18)))
    (query,) = storage_ops(sched.next_execution_plan())
    op = query
    if stage != "query":
        sched.advance_head([], [], [ok(query, 3)])
        (op,) = storage_ops(sched.next_execution_plan())
    if stage == "fetched":
        sched.advance_head([], [], [ok(op, 1)])  # settled: waiting, holding its pages
    sched.advance_head(["a"])
    assert not sched.holds("a") and not sched.storage.preparing
    if stage == "fetched":  # its pages stay in L2, published and unreferenced
        assert sched.host_tier.host.num_active == 0 and sched.host_tier.host.num_published == 3
        sched.check_idle()
        return
    (cancel,) = storage_ops(sched.next_execution_plan())
    assert cancel == CancelOp(op.op_id)
    with pytest.raises(AssertionError, match="storage still holds"):
        sched.check_idle()  # the op keeps its blocks until it completes
    sched.advance_head([], [], [failed(op, "cancelled")])
    sched.check_idle()


def test_landed_l2_pages_are_published_once():
    sched = make()
    a = submit(sched, "a", list(range(5, 18)))
    (query,) = storage_ops(sched.next_execution_plan())
    sched.advance_head([], [], [ok(query, 0)])  # a miss: computed
    plan = sched.next_execution_plan()
    run_out(sched, plan)
    plan = sched.next_execution_plan()  # the write-through of its 3 blocks
    run_out(sched, plan, "a")
    plan = sched.next_execution_plan()
    (put,) = [op for op in storage_ops(plan) if isinstance(op, PutOp)]
    assert put.keys == tuple(a.block_hashes[:3])
    assert all(sched.host_tier.host.ref_count(b) == 1 for b in put.host_blocks)
    run_out(sched, plan)
    for _ in range(3):
        run_out(sched, sched.next_execution_plan())
    b = submit(sched, "b", list(range(5, 18)))  # the same prompt: a device hit, no query
    plan = sched.next_execution_plan()
    assert not storage_ops(plan) and b.status is Status.RUNNING
    run_out(sched, plan, "b")
    for _ in range(3):
        plan = sched.next_execution_plan()
        assert not [op for op in storage_ops(plan) if isinstance(op, PutOp)]
        run_out(sched, plan)
    sched.check_idle()


def test_nothing_is_prepared_or_published_while_the_store_is_down():
    sched = make()
    a = submit(sched, "a", list(range(5, 18)))
    sched.advance_head([], [], [], store_up=False)  # agreed at the head: down on a rank
    plan = sched.next_execution_plan()
    assert not storage_ops(plan) and a.status is Status.RUNNING and a.storage_settled
    assert plan.rows[0].num_tokens == 13 and sched.storage.stats.unprepared == 1
    run_out(sched, plan, store_up=False)
    plan = sched.next_execution_plan()  # the write-through of its 3 blocks lands
    run_out(sched, plan, "a", store_up=False)
    for _ in range(3):
        plan = sched.next_execution_plan()
        assert not storage_ops(plan)  # dropped, not published
        run_out(sched, plan, store_up=False)
    assert sched.storage.stats.dropped_puts == 3
    sched.check_idle()
    sched.advance_head([], [], [], store_up=True)  # back: the next request is prepared
    b = submit(sched, "b", list(range(100, 113)))
    (query,) = storage_ops(sched.next_execution_plan())
    assert isinstance(query, QueryOp) and b.status is Status.PREPARING


def report(*results: StorageResult, depth: int = 0, up: bool = True):
    return StorageReport(0.0, depth, list(results), up).wire()


def test_the_replica_agrees_once_every_member_reported():
    ops = StorageOps(members=2)
    plan = ExecutionPlan(plan_id=0)
    sched = make()
    submit(sched, "a", list(range(5, 18)))
    submit(sched, "b", list(range(40, 53)))
    plan = sched.next_execution_plan()
    qa, qb = ops.dispatched(plan)
    # member 0 has both, member 1 only qa so far: qa completes, qb waits
    agreed = ops.agree([report(ok(qa, 3), ok(qb, 2)), report(ok(qa, 1), depth=1)])
    assert agreed == [StorageResult(qa.op_id, True, 1, None, 0.0)]  # the smallest run
    assert ops.open == 1 and ops.stats.queue_depth == 1
    assert ops.store_up
    agreed = ops.agree([report(), report(failed(qb), up=False)])  # a failure on any member
    assert [(r.op_id, r.ok, r.error) for r in agreed] == [(qb.op_id, False, "timed out")]
    assert not ops.store_up  # ... and a store down on any member: down for the replica
    ops.agree([report(), report()])
    assert ops.store_up
    ops.check_idle()


def test_an_invalid_report_is_named():
    ops = StorageOps()
    sched = make()
    submit(sched, "a", list(range(5, 18)))
    (query,) = ops.dispatched(sched.next_execution_plan())
    assert ops.check(StorageReport(0.0, 0, [ok(query)])) is None
    assert "reported twice" in ops.check(StorageReport(0.0, 0, [ok(query)]))
    assert "not open" in ops.check(StorageReport(0.0, 0, [StorageResult(99, True)]))
