"""The cache_ops subsystem: it counts the open ops of the plans it is shown, polls only
while one is open, advances an ACK only once every rank of the replica holds it, and
refuses a repeated, unknown, lost or overdue ACK with a CacheOpError."""

from __future__ import annotations

import pytest

from tests.collective.harness import run_ranks
from tokenspeed_aio.collective import CollectiveError, Mesh
from tokenspeed_aio.control.cache_ops import CacheOpError, CacheOps, CacheResults
from tokenspeed_aio.scheduler.cache_ops import CachePlan, LoadBackOp, WriteBackOp
from tokenspeed_aio.scheduler.plan import ExecutionPlan


def plan_with(*op_ids: int) -> ExecutionPlan:
    cache = CachePlan(
        write_backs=[WriteBackOp(i, (1,), (2,), False, "write_through") for i in op_ids[:1]],
        loads=[LoadBackOp(i, "r", (3, 4), (5, 6)) for i in op_ids[1:]],
    )
    return ExecutionPlan(plan_id=0, cache=cache)


class Poll:
    """The data plane's completion query, scripted: each call returns the next results."""

    def __init__(self, *results: tuple[list[int], int]) -> None:
        self.results = [CacheResults(list(a), n) for a, n in results]
        self.calls = 0
        self.landed = 0

    def __call__(self) -> CacheResults:
        self.calls += 1
        if self.results:
            result = self.results.pop(0)
            self.landed = result.landed
            return result
        return CacheResults([], self.landed)


async def test_polls_only_while_an_op_is_open_and_closes_each_once():
    ops = CacheOps(block_bytes=100)
    poll = Poll(([], 0), ([1, 2], 2))
    assert await ops.acknowledged(poll) == [] and poll.calls == 0  # nothing open: no poll
    ops.dispatched(plan_with(1, 2))
    assert ops.open == 2
    assert await ops.acknowledged(poll) == []  # open, nothing landed yet
    assert await ops.acknowledged(poll) == [1, 2]
    assert ops.open == 0 and poll.calls == 2
    assert await ops.acknowledged(poll) == [] and poll.calls == 2
    assert ops.stats.get("load_back").blocks == 2
    ops.check_idle()


@pytest.mark.parametrize(
    ("results", "message"),
    [
        ([([1], 1), ([1], 2)], "acknowledged twice"),  # repeated after it was agreed
        ([([2, 2], 2)], "acknowledged twice"),  # repeated within one poll
        ([([9], 1)], "never dispatched"),
        ([([1], 2)], r"1 acknowledgment\(s\) lost"),  # landed twice as many as reported
    ],
)
async def test_a_broken_ack_is_a_cache_op_error(results, message):
    ops = CacheOps()
    ops.dispatched(plan_with(1, 2))
    poll = Poll(*results)
    with pytest.raises(CacheOpError, match=message):
        for _ in results:
            await ops.acknowledged(poll)


async def test_an_op_never_acknowledged_is_a_cache_op_error():
    ops = CacheOps(timeout=0.0)
    ops.dispatched(plan_with(1))
    with pytest.raises(CacheOpError, match=r"cache ops \[1\] not acknowledged"):
        await ops.acknowledged(Poll(([], 0)))


async def test_an_ack_advances_only_once_every_rank_holds_it():
    """Rank 0's copy lands a round before rank 1's: neither advances until both hold it."""

    async def body(mesh: Mesh):
        ops = CacheOps(mesh.world)
        ops.dispatched(plan_with(1, 2))
        if mesh.rank == 0:
            poll = Poll(([1, 2], 2), ([], 2))
        else:
            poll = Poll(([2], 1), ([1], 2))
        return [await ops.acknowledged(poll), await ops.acknowledged(poll), ops.open]

    results = await run_ranks(2, body)
    assert results == [[[2], [1], 0], [[2], [1], 0]]


async def test_a_broken_ack_on_one_rank_stops_every_rank_together():
    async def body(mesh: Mesh):
        ops = CacheOps(mesh.world)
        ops.dispatched(plan_with(1))
        poll = Poll(([1, 1], 2)) if mesh.rank == 1 else Poll(([1], 1))
        await ops.acknowledged(poll)

    errors = await run_ranks(2, body)
    for err in errors:
        assert isinstance(err, CollectiveError), err
        assert "CacheOpError: cache op 1 was acknowledged twice" in str(err)
