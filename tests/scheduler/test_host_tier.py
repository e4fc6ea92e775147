"""The scheduler's host tier alone, vLLM-style: next_execution_plan(), made-up commits and
acknowledgments, asserting on the plan's cache ops, reference counts, request states and
KV events. (The tokens, with the tier on, are checked through the real round in
tests/control/test_round_host_tier.py.)"""

from __future__ import annotations

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.cache_ops import WRITE_BACK, WRITE_THROUGH
from tokenspeed_aio.scheduler.host_pool import HostBlockPool
from tokenspeed_aio.scheduler.kv_events import CPU, GPU, BlockRemoved, BlockStored, KVEventLog
from tokenspeed_aio.scheduler.plan import ExecutionPlan, ForwardCommitted, RequestFinished
from tokenspeed_aio.scheduler.request import Request, Status
from tokenspeed_aio.scheduler.scheduler import HostTierConfig, Scheduler, SchedulerConfig


def make(policy: str = WRITE_THROUGH, host_blocks: int = 64, **config) -> Scheduler:
    cfg = dict(
        num_blocks=16,
        page_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        max_model_len=512,
        enable_prefix_caching=True,
    )
    cfg.update(config)
    return Scheduler(SchedulerConfig(**cfg, host=HostTierConfig(host_blocks, 8, 4, policy)))


def submit(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 16) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    req = Request(rid, prompt, params, seed=0, max_output=max_tokens)
    sched.submit([req])
    return req


def commit(sched: Scheduler, plan: ExecutionPlan, *finished: str) -> None:
    """A made-up commit of ``plan`` (token 1 for each sampling row), then the requests the
    output processor would have ended."""
    tokens = [1] * len(plan.sample_rows)
    sched.advance([ForwardCommitted(plan.plan_id, tokens), *map(RequestFinished, finished)])


def ack_all(sched: Scheduler, plan: ExecutionPlan) -> None:
    sched.advance_head([], [op.op_id for op in plan.cache.ops()] if plan.cache else [])


def test_write_through_pins_its_sources_and_publishes_after_the_ack():
    sched = make()
    submit(sched, "a", list(range(8)) + [99], max_tokens=5)  # 2 full blocks
    prefill = sched.next_execution_plan()
    assert prefill.cache is None  # the blocks' forward is in this plan: stored next plan
    commit(sched, prefill)
    stored = sched.drain_kv_events()
    assert [(type(e), e.medium) for e in stored] == [(BlockStored, GPU)] * 2
    plan = sched.next_execution_plan()
    (op,) = plan.cache.write_backs
    assert not op.stream_ordered and op.reason == "write_through" and op.num_blocks == 2
    assert [sched.pool.ref_count(b) for b in op.src_blocks] == [2, 2]  # owner + pin
    assert sched.drain_kv_events() == []  # not in L2 before the ACK
    sched.advance_head([], [op.op_id])
    cpu = sched.drain_kv_events()
    assert [(type(e), e.medium) for e in cpu] == [(BlockStored, CPU)] * 2
    assert {e.block_hash for e in cpu} == {e.block_hash for e in stored}  # one hash chain
    assert [sched.pool.ref_count(b) for b in op.src_blocks] == [1, 1]


def test_write_back_stores_a_block_only_when_it_is_evicted():
    sched = make(WRITE_BACK, num_blocks=6)  # 5 usable blocks
    submit(sched, "a", list(range(8)) + [99], max_tokens=1)
    commit(sched, sched.next_execution_plan(), "a")
    assert sched.next_execution_plan().cache is None  # cached on the device only
    submit(sched, "b", list(range(50, 66)) + [98], max_tokens=1)  # 5 blocks: evicts a's 2
    plan = sched.next_execution_plan()
    (op,) = plan.cache.write_backs
    assert op.stream_ordered and op.reason == "evicted" and op.num_blocks == 2
    assert set(op.src_blocks) <= set(sched.requests["b"].block_ids)  # re-granted already


def test_a_victim_is_imaged_then_restored_only_after_both_stores_landed():
    sched = make(WRITE_BACK, num_blocks=8, max_num_batched_tokens=32)  # 7 usable blocks
    old = submit(sched, "old", list(range(10)), max_tokens=30)
    new = submit(sched, "new", list(range(40, 50)), max_tokens=30)
    plans = [sched.next_execution_plan()]
    while not plans[-1].num_retracted:
        commit(sched, plans[-1])
        plans.append(sched.next_execution_plan())
    retracting = plans[-1]
    assert new.status is Status.WAITING and new.image is not None and old.status is Status.RUNNING
    (snapshot,) = retracting.cache.snapshots
    (store,) = [op for op in retracting.cache.write_backs if op.reason == "retraction"]
    assert store.stream_ordered and snapshot.rid == "new"
    assert len(store.src_blocks) + len(snapshot.src_blocks) == -(-new.image.num_computed // 4)
    commit(sched, retracting)
    sched.advance_head([], [snapshot.op_id])  # the write-back has not landed yet
    waiting = sched.next_execution_plan()
    assert not (waiting.cache and waiting.cache.restores)  # cache-gated
    commit(sched, waiting)
    sched.advance_head([], [store.op_id])
    sched.advance([RequestFinished("old")])
    plan = sched.next_execution_plan()
    (restore,) = plan.cache.restores
    assert restore.rid == "new" and new.status is Status.RESTORING
    assert list(restore.dst_blocks) == new.block_ids and restore.slot == new.slot
    assert all(row.rid != "new" for row in plan.rows)  # unschedulable until the ACK
    computed = new.image.num_computed
    sched.advance_head([], [restore.op_id])
    assert new.status is Status.RUNNING and new.num_computed == computed and new.image is None
    row = next(r for r in sched.next_execution_plan().rows if r.rid == "new")
    assert row.start == computed and row.block_offset == 0  # the whole table is resent


def test_an_aborted_restore_keeps_its_blocks_until_it_lands():
    sched = make(num_blocks=8, max_num_batched_tokens=32)
    submit(sched, "old", list(range(10)), max_tokens=30)
    new = submit(sched, "new", list(range(40, 50)), max_tokens=30)
    plan = sched.next_execution_plan()
    while not plan.num_retracted:
        commit(sched, plan)
        ack_all(sched, plan)  # the write-throughs land
        plan = sched.next_execution_plan()
    commit(sched, plan)
    ack_all(sched, plan)
    sched.advance([RequestFinished("old")])
    plan = sched.next_execution_plan()
    (restore,) = plan.cache.restores
    sched.advance_head(["new"])  # the client cancels while the restore is in flight
    assert new.status is Status.FINISHED and sched.holds("new")
    assert all(sched.pool.ref_count(b) == 1 for b in restore.dst_blocks)
    sched.advance_head([], [restore.op_id])
    assert not sched.holds("new") and all(sched.pool.ref_count(b) == 0 for b in restore.dst_blocks)
    while sched.has_work():
        plan = sched.next_execution_plan()
        ack_all(sched, plan)
    sched.check_idle()


def test_a_frozen_round_plans_the_due_write_backs_and_nothing_else():
    sched = make()
    submit(sched, "a", list(range(8)) + [99], max_tokens=5)
    commit(sched, sched.next_execution_plan())
    submit(sched, "b", [1, 2, 3])
    plan = sched.next_execution_plan(allow_forward=False)
    assert plan.rows == [] and plan.cache.write_backs and not plan.cache.loads
    assert [r.rid for r in sched.waiting] == ["b"]


def test_a_flush_waits_for_the_tier_and_clears_both_tiers():
    sched = make()
    submit(sched, "a", list(range(8)) + [99], max_tokens=1)
    commit(sched, sched.next_execution_plan(), "a")
    plan = sched.next_execution_plan()  # the write-through, in flight
    assert not sched.can_clear_cache()
    ack_all(sched, plan)
    assert sched.can_clear_cache() and sched.host_tier.host.num_published == 2
    assert sched.reset_prefix_cache()
    assert sched.host_tier.host.num_published == 0 and sched.pool.cached_hashes() == set()


def test_l2_evicts_its_least_recently_used_block_and_events_net_per_round():
    log = KVEventLog()
    host = HostBlockPool(2, log)
    keys = [(h, None, (h,)) for h in (11, 12, 13)]
    for key in keys[:2]:
        (block,) = host.allocate(1)
        host.reserve(block, key)
        host.landed([block])
        host.unref([block])
    assert [type(e) for e in log.drain()] == [BlockStored, BlockStored]
    host.ref(host.lookup(keys[:1]))  # 11 is used again: 12 is now the least recent
    host.unref(host.lookup(keys[:1]))
    (block,) = host.allocate(1)
    assert host.lookup(keys[1:2]) == [] and host.lookup(keys[:1]) != []
    host.reserve(block, keys[2])
    host.landed([block])
    events = log.drain()
    assert [(type(e), e.block_hash, e.medium) for e in events] == [
        (BlockRemoved, 12, CPU),
        (BlockStored, 13, CPU),
    ]
    # Published and evicted again between two drains: nothing to publish for it.
    one = HostBlockPool(1, log)
    (block,) = one.allocate(1)
    one.reserve(block, (21, None, (21,)))
    one.landed([block])
    one.unref([block])
    one.allocate(1)
    assert log.drain() == []
