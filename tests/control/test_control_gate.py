"""The control gate on its own (no model, no ranks): a gated op and a release under
attention DP wait for every rank's share, decide from the shares alone, and keep their
order with the round's requests."""

from __future__ import annotations

from tokenspeed_aio.control.control import Control
from tokenspeed_aio.control.control_step import ControlView
from tokenspeed_aio.control.ingress import Admission
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.request import Request
from tokenspeed_aio.wire.control import ControlCall, FlushCache, PauseGeneration, ReleaseMemory

IDLE = ControlView(drained=True, can_clear_cache=True)


class Device:
    def __init__(self) -> None:
        self.released: list[list[str]] = []

        self.storage_deletes = 0

    async def release_memory(self, tags: list[str]) -> None:
        self.released.append(tags)

    async def delete_storage(self) -> None:
        self.storage_deletes += 1


class Group:
    """Every rank agrees with this one (the reductions' values are all this rank's)."""

    ranks = (0, 1)

    async def all_gather(self, value, *, error=None, timeout=None):
        return [value, value]


def request(rid: str) -> Request:
    return Request(rid, [5, 6], SamplingParams(max_tokens=2), seed=0, max_output=2)


def admission(*items) -> Admission:
    adm = Admission()
    for index, item in enumerate(items):
        if isinstance(item, ControlCall):
            adm.calls.append((index, item))
        else:
            adm.requests.append(item)
            adm.positions[item.rid] = index
    return adm


async def test_a_gated_op_runs_only_once_every_rank_holds_it_at_its_head():
    control = Control(Device(), Group(), dp=True)
    flush = ControlCall(7, FlushCache())
    step = await control.gate(admission(flush), IDLE, [])  # arrives: never due at once
    assert not step.flush_cache and control.gated.head_id == 7
    step = await control.gate(admission(), IDLE, [])  # no exchange yet
    assert not step.flush_cache
    step = await control.gate(
        admission(), IDLE, [(7, False, False, False), (-1, False, False, False)]
    )
    assert not step.flush_cache  # the peer has not received it
    step = await control.gate(admission(), IDLE, [(7, False, False, False)] * 2)
    assert step.flush_cache and [r.call_id for r in control.take_replies()] == [7]
    assert control.gated.head_id == -1


async def test_a_release_waits_until_every_rank_drained_and_holds_admission():
    device = Device()
    control = Control(device, Group(), dp=True)
    release = ControlCall(3, ReleaseMemory(tags=["kv_cache"]))
    await control.gate(admission(release), IDLE, [])
    assert control.holding and device.released == []
    not_ready = [(-1, True, True, False), (-1, False, False, False)]  # the peer may admit
    step = await control.gate(admission(), IDLE, not_ready)
    assert device.released == [] and step.allow_forward
    step = await control.gate(
        admission(), IDLE, [(-1, True, True, False), (-1, False, True, False)]
    )
    assert device.released == [["kv_cache"]] and step.flush_cache and not step.allow_forward
    assert control.share(True) == (-1, False, True, True)


async def test_requests_before_a_pause_are_admitted_and_those_after_it_held():
    control = Control(Device())
    a, b = request("a"), request("b")
    step = await control.gate(
        admission(a, ControlCall(1, PauseGeneration(mode="keep")), b), IDLE, None
    )
    assert step.requests == [a] and control.holds("b") and not step.allow_forward
