"""Collectives over real loopback TCP, ranks as tasks of this process."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from tokenspeed_aio.collective import (
    CollectiveError,
    CollectiveOrderError,
    Mesh,
    MeshError,
    PeerLostError,
    Ranks,
)

from .harness import run_ranks


@pytest.mark.parametrize("world", [1, 2, 4])
async def test_all_gather_broadcast_and_reduce_agree_on_every_rank(world):
    async def body(mesh: Mesh):
        group = mesh.world
        rank = mesh.rank
        return (
            await group.all_gather({"rank": rank, "tokens": [rank] * 3}),
            await group.broadcast(f"from {rank}", root=world - 1),
            await group.all_reduce(rank + 0.5, "sum"),
            await group.all_reduce(rank, "min"),
            await group.all_reduce([rank, -rank, rank % 2 == 0], "max"),
            await group.all_reduce(rank % 2 == 0, "sum"),
        )

    results = await run_ranks(world, body)
    expected = (
        [{"rank": r, "tokens": [r] * 3} for r in range(world)],
        f"from {world - 1}",
        sum(r + 0.5 for r in range(world)),
        0,
        [world - 1, 0, True],
        sum(r % 2 == 0 for r in range(world)),
    )
    assert results == [expected] * world


async def test_subgroups_of_tp2_dp2_run_interleaved_in_one_round():
    async def body(mesh: Mesh):
        ranks = Ranks.build(mesh.rank, mesh.world_size, tp=2, dp=2)
        replica = mesh.group(ranks.replica)
        column = mesh.group(ranks.dp_column)
        world = mesh.group(ranks.world)
        leader = ranks.replica_leader
        round_inputs = await replica.broadcast(f"requests of replica {ranks.dp_rank}", root=leader)
        batch_sizes = await world.all_gather(ranks.dp_rank + 1)
        tp_view = await replica.all_gather(ranks.tp_rank)
        column_max = await column.all_reduce(mesh.rank, "max")
        return round_inputs, batch_sizes, tp_view, column_max

    results = await run_ranks(4, body)
    assert results == [
        ("requests of replica 0", [1, 1, 2, 2], [0, 1], 2),
        ("requests of replica 0", [1, 1, 2, 2], [0, 1], 3),
        ("requests of replica 1", [1, 1, 2, 2], [0, 1], 2),
        ("requests of replica 1", [1, 1, 2, 2], [0, 1], 3),
    ]


async def test_group_of_one_returns_without_any_peer_taking_part():
    async def body(mesh: Mesh):
        if mesh.rank == 1:
            return None  # never enters a collective
        alone = mesh.group([mesh.rank])  # rank 1 never answers: any wait would time out
        return (
            await alone.all_gather((1, 2)),
            await alone.broadcast("x", root=0),
            await alone.all_reduce([1, 2], "sum"),
        )

    results = await run_ranks(2, body)
    assert results[0] == ([[1, 2]], "x", [1, 2])


async def test_values_make_the_same_round_trip_on_every_rank():
    """A tuple arrives as a list on peers, so the sender sees a list too (rank-identical)."""

    async def body(mesh: Mesh):
        return await mesh.world.all_gather((mesh.rank, "a"))

    assert await run_ranks(2, body) == [[[0, "a"], [1, "a"]]] * 2


async def test_a_rank_error_is_raised_identically_everywhere_and_the_group_stays_usable():
    async def body(mesh: Mesh):
        group = mesh.world
        error = "grammar failed to compile" if mesh.rank == 2 else None
        with pytest.raises(CollectiveError) as raised:
            await group.all_gather(mesh.rank, error=error)
        after = await group.all_gather(mesh.rank)
        return raised.value, after

    results = await run_ranks(4, body)
    for err, after in results:
        assert (err.rank, err.message) == (2, "grammar failed to compile")
        assert err.op == "all_gather"
        assert "rank 2: grammar failed to compile" in str(err)
        assert after == [0, 1, 2, 3]


async def test_agree_and_all_reduce_report_every_failing_rank_in_rank_order():
    async def body(mesh: Mesh):
        group = mesh.world
        await group.agree(None)
        with pytest.raises(CollectiveError) as agreed:
            await group.agree(f"storage poll invalid on {mesh.rank}" if mesh.rank else None)
        with pytest.raises(CollectiveError) as reduced:
            await group.all_reduce(1, "sum", error="oom" if mesh.rank == 1 else None)
        return agreed.value.errors, reduced.value.errors

    results = await run_ranks(3, body)
    expected = (
        [(1, "storage poll invalid on 1"), (2, "storage poll invalid on 2")],
        [(1, "oom")],
    )
    assert results == [expected] * 3


async def test_an_unencodable_value_becomes_that_ranks_agreed_error():
    async def body(mesh: Mesh):
        value = object() if mesh.rank == 1 else 7
        with pytest.raises(CollectiveError) as raised:
            await mesh.world.all_gather(value)
        return raised.value.rank, raised.value.message

    results = await run_ranks(2, body)
    assert results[0] == results[1]
    assert results[0][0] == 1
    assert results[0][1].startswith("cannot encode value")


async def test_values_that_do_not_reduce_raise_the_same_error_on_every_rank():
    async def body(mesh: Mesh):
        value = [1, 2, 3] if mesh.rank == 1 else [1, 2]
        with pytest.raises(CollectiveError) as raised:
            await mesh.world.all_reduce(value, "sum")
        return str(raised.value)

    results = await run_ranks(3, body)
    assert len(set(results)) == 1
    assert "rank 1: gave a list of length 3, expected 2" in results[0]


async def test_a_different_call_order_is_detected_and_leaves_the_group_unusable():
    async def body(mesh: Mesh):
        group = mesh.world
        await group.all_gather("in step")
        with pytest.raises(CollectiveOrderError) as raised:
            if mesh.rank == 0:
                await group.all_gather("gather")
            else:
                await group.all_reduce(1, "sum")
        with pytest.raises(MeshError, match="unusable after an earlier failure"):
            await group.all_gather("again")
        return str(raised.value)

    results = await run_ranks(2, body)
    assert "rank 0 entered all_gather #2, but rank 1 sent all_reduce(sum) #2" in results[0]
    assert "rank 1 entered all_reduce(sum) #2, but rank 0 sent all_gather #2" in results[1]


async def test_a_skipped_broadcast_is_detected_at_the_next_call():
    async def body(mesh: Mesh):
        group = mesh.world
        if mesh.rank == 0:
            await group.broadcast("only rank 0 thinks this happens", root=0)
        with pytest.raises(CollectiveOrderError) as raised:
            await group.all_gather(mesh.rank)
        return str(raised.value)

    results = await run_ranks(2, body)
    assert "rank 1 entered all_gather #1, but rank 0 sent broadcast(root=0) #1" in results[1]


async def test_a_hung_peer_raises_peer_lost_after_the_timeout():
    hung = asyncio.Event()

    async def body(mesh: Mesh):
        if mesh.rank == 1:
            await hung.wait()  # alive, connected, never answers
            return None
        started = time.monotonic()
        try:
            with pytest.raises(PeerLostError) as raised:
                await mesh.world.all_gather(0, timeout=0.3)
        finally:
            hung.set()
        return raised.value, time.monotonic() - started

    (err, elapsed), _ = await run_ranks(2, body)
    assert 0.3 <= elapsed < 2.0
    assert (err.peer, err.op) == (1, "all_gather")
    assert "rank 1 did not answer all_gather #1 over ranks [0, 1] within 0.3 s" in str(err)


async def test_a_closed_peer_is_seen_at_once_even_while_waiting_on_another():
    """Rank 0 waits on rank 1 (hung) when rank 2 closes: it names rank 2 promptly."""
    release = asyncio.Event()

    async def body(mesh: Mesh):
        if mesh.rank == 1:
            await release.wait()
            return None
        if mesh.rank == 2:
            await asyncio.sleep(0.2)
            await mesh.close()
            return None
        started = time.monotonic()
        try:
            with pytest.raises(PeerLostError) as raised:
                await mesh.world.all_gather(0, timeout=math.inf)
        finally:
            release.set()
        return raised.value, time.monotonic() - started

    (err, elapsed), _, _ = await run_ranks(3, body)
    assert elapsed < 2.0
    assert err.peer == 2
    assert "rank 2 closed its connection" in str(err)
    assert "rank 0 was in all_gather #1 over ranks [0, 1, 2]" in str(err)


async def test_a_rank_between_collectives_learns_a_peer_is_lost():
    """``peer_lost`` returns once a peer's connection ends, though no collective runs; a peer
    already gone when it is called is reported at once."""

    async def body(mesh: Mesh):
        if mesh.rank == 1:
            await asyncio.sleep(0.2)
            await mesh.close()
            return None
        started = time.monotonic()
        why = await asyncio.wait_for(mesh.peer_lost(), 5)
        return why, time.monotonic() - started, await asyncio.wait_for(mesh.peer_lost(), 1)

    (why, elapsed, again), _ = await run_ranks(2, body)
    assert why == again == "rank 1 closed its connection (EOF)"
    assert 0.1 < elapsed < 2.0


async def test_a_peer_that_sent_its_part_and_left_still_completes_the_call():
    async def body(mesh: Mesh):
        if mesh.rank == 1:
            await mesh.world.broadcast("last words", root=1)
            await mesh.close()
            return None
        await asyncio.sleep(0.2)  # rank 1 is gone by now; its frame arrived before the EOF
        first = await mesh.world.broadcast(None, root=1)
        with pytest.raises(PeerLostError, match="rank 1 closed its connection"):
            await mesh.world.all_gather(0)
        return first

    assert (await run_ranks(2, body))[0] == "last words"


async def test_closing_the_mesh_fails_a_waiting_call():
    async def body(mesh: Mesh):
        if mesh.rank == 1:
            await asyncio.sleep(0.5)
            return None
        call = asyncio.ensure_future(mesh.world.all_gather(0))
        await asyncio.sleep(0.05)
        await mesh.close()
        with pytest.raises(MeshError, match="closed"):
            await call
        with pytest.raises(MeshError, match="closed"):
            await mesh.world.all_gather(0)
        return None

    assert await run_ranks(2, body) == [None, None]


async def test_overlapping_calls_on_one_group_are_refused():
    async def body(mesh: Mesh):
        first = asyncio.ensure_future(mesh.world.all_gather(mesh.rank))
        await asyncio.sleep(0)
        if mesh.rank == 0:
            with pytest.raises(RuntimeError, match="is running"):
                await mesh.world.all_gather("overlap")
        return await first

    assert await run_ranks(2, body) == [[0, 1], [0, 1]]


async def test_group_membership_is_checked():
    async def body(mesh: Mesh):
        with pytest.raises(ValueError, match="not in the group"):
            mesh.group([1 - mesh.rank])
        with pytest.raises(ValueError, match="outside the world"):
            mesh.group([mesh.rank, 5])
        with pytest.raises(ValueError, match="root 3 is not in the group"):
            await mesh.world.broadcast(0, root=3)
        with pytest.raises(ValueError, match="op must be one of"):
            await mesh.world.all_reduce(0, "mean")  # type: ignore[arg-type]
        assert mesh.group([1, 0, 1]) is mesh.world
        return None

    assert await run_ranks(2, body) == [None, None]
