"""The replica's relay over an in-process group: the owner's messages reach every
member in one exchange, a closed frontend reads as a stop on all of them, a rank-local
error rides the exchange; and two real EventLoops relayed this way run the same rounds."""

from __future__ import annotations

import asyncio

import pytest
from helpers.fake_group import FakeGroup
from helpers.sim_data_plane import SimForwardError
from helpers.sim_engine import SimEngine, expected

from tokenspeed_aio.collective.errors import CollectiveError
from tokenspeed_aio.control.relay import Relay
from tokenspeed_aio.control.transport import LocalTransport
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.wire.messages import (
    AbortRequest,
    GenerateRequest,
    Load,
    OutputBatch,
    StopEngine,
)

LOAD = Load(0, 0, 0, 0, 8)


def replica(size: int = 2) -> tuple[LocalTransport, list[Relay]]:
    transport, group = LocalTransport(), FakeGroup(size)
    owner = Relay(transport, group.member(0))
    members = [Relay(None, group.member(r), is_owner=False) for r in range(1, size)]
    return transport, [owner, *members]


async def test_a_replica_of_one_is_the_transport_itself():
    transport = LocalTransport()
    relay = Relay(transport)
    msg = GenerateRequest("a", [1, 2], SamplingParams(max_tokens=2), 0)
    transport.put(msg)
    assert await relay.receive(None) == [msg]
    assert await relay.receive(None) == []
    relay.send(OutputBatch([], LOAD))
    assert transport.outputs.get_nowait() == OutputBatch([], LOAD)
    with pytest.raises(ValueError, match="first member needs the frontend transport"):
        Relay(None)


async def test_the_owners_messages_reach_every_member_in_one_exchange():
    transport, relays = replica(3)
    sent = [GenerateRequest("a", [1, 2], SamplingParams(max_tokens=2), 5), AbortRequest("b")]
    for msg in sent:
        transport.put(msg)
    received = await asyncio.gather(*(r.receive(None) for r in relays))
    assert received == [sent, sent, sent]
    assert [type(m) for m in received[2]] == [GenerateRequest, AbortRequest]
    assert await asyncio.gather(*(r.receive(None) for r in relays)) == [[], [], []]


async def test_storage_reports_ride_the_same_exchange():
    """With L3 each member's storage report travels in the round's one exchange; a
    member's broken report is an error every member raises from that exchange."""
    transport, relays = replica(2)
    transport.put(AbortRequest("a"))
    reports = [(1.0, 0, [(3, True, 2, None, 0.1)]), (1.5, 4, [])]
    received = await asyncio.gather(*(r.receive(None, report=p) for r, p in zip(relays, reports)))
    assert received == [[AbortRequest("a")]] * 2
    assert [r.group.calls for r in relays] == [1, 1]  # one exchange
    assert relays[0].reports == relays[1].reports == reports
    errors = [None, "StorageOpError: storage op 9 was reported but is not open"]
    with pytest.raises(CollectiveError, match="storage op 9"):
        await asyncio.gather(*(r.receive(None, error=e) for r, e in zip(relays, errors)))


async def test_members_wait_for_the_owner_and_only_the_owner_sends():
    transport, (owner, member) = replica()
    waiting = asyncio.create_task(member.receive(None))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # the owner may idle up to a heartbeat before it joins
    transport.put(AbortRequest("x"))
    assert await owner.receive(0.5) == [AbortRequest("x")]
    assert await waiting == [AbortRequest("x")]
    member.send(OutputBatch([], LOAD))  # a member holds no transport: nothing is sent
    owner.send(OutputBatch([], LOAD))
    assert transport.outputs.qsize() == 1


async def test_a_closed_frontend_reads_as_a_stop_on_every_member():
    transport, relays = replica()
    await transport.close()
    assert await asyncio.gather(*(r.receive(None) for r in relays)) == [[StopEngine()]] * 2


@pytest.mark.parametrize("failing", [0, 1])
async def test_a_rank_local_error_rides_the_exchange(failing):
    transport, relays = replica()
    transport.put(AbortRequest("x"))
    errors = [f"ValueError: rank {failing} broke" if r == failing else None for r in (0, 1)]
    results = await asyncio.gather(
        *(relay.receive(None, error=err) for relay, err in zip(relays, errors)),
        return_exceptions=True,
    )
    for err in results:
        assert isinstance(err, CollectiveError)
        assert (err.rank, err.message) == (failing, f"ValueError: rank {failing} broke")


def relayed_engines(depth: int, **kw) -> tuple[SimEngine, SimEngine]:
    group = FakeGroup(2)
    owner = SimEngine(depth=depth, group=group.member(0), **kw)
    member = SimEngine(depth=depth, group=group.member(1), is_owner=False, **kw)
    return owner, member


@pytest.mark.parametrize("depth", [0, 1])
async def test_relayed_loops_run_the_same_rounds(depth):
    owner, member = relayed_engines(depth, max_num_batched_tokens=8)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3, 3, 9, 8, 8]]
    streams = [owner.generate(f"r{i}", p, max_tokens=6) for i, p in enumerate(prompts)]
    await asyncio.gather(owner.round(), member.round())
    owner.abort("r2")
    while owner.busy():
        await asyncio.gather(owner.round(), member.round())
    assert member.loop.idle()
    assert streams[0].tokens == expected(prompts[0], 6)
    assert streams[1].tokens == expected(prompts[1], 6)
    assert streams[2].finish_reason == "abort"
    rows = [
        [(r.rid, r.slot, r.start, r.num_tokens) for r in p.rows] for p in owner.data_plane.plans
    ]
    assert rows == [
        [(r.rid, r.slot, r.start, r.num_tokens) for r in p.rows] for p in member.data_plane.plans
    ]
    owner.generate("late", [5, 5], max_tokens=3)
    owner._put(StopEngine())  # the stop rides the relay: both stop after the same round
    await asyncio.wait_for(asyncio.gather(owner.loop.run(), member.loop.run()), 5)
    owner.collect()
    assert owner.stream("late").finish_reason == "abort"
    assert owner.loop.stats.rounds == member.loop.stats.rounds
    owner.loop.check_idle()
    member.loop.check_idle()


@pytest.mark.parametrize("failing", ["owner", "member"])
async def test_a_failed_forward_on_one_rank_fails_every_rank_together(failing):
    kw = dict(fail_plan=3) if failing == "owner" else {}
    group = FakeGroup(2)
    owner = SimEngine(depth=1, group=group.member(0), **kw)
    member = SimEngine(
        depth=1, group=group.member(1), is_owner=False, **({} if kw else dict(fail_plan=3))
    )
    owner.generate("a", [1, 2, 3], max_tokens=50)
    results = await asyncio.wait_for(
        asyncio.gather(owner.loop.run(), member.loop.run(), return_exceptions=True), 5
    )
    rank = 0 if failing == "owner" else 1
    for err in results:
        assert isinstance(err, CollectiveError), err
        assert err.rank == rank and SimForwardError.__name__ in err.message
        assert "injected failure of forward 3" in err.message
    assert group.member(0).calls == group.member(1).calls  # no rank left inside an exchange
