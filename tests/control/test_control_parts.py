"""The control subsystem's parts on their own: the frontend's reply combination, the
DP replicas' KV-event endpoints, the weight payload's unpickler (which must refuse
anything but tensors: the bytes come from the network)."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest
import torch

from tokenspeed_aio.api.control_calls import ControlCalls
from tokenspeed_aio.control.kv_publisher import replica_endpoints
from tokenspeed_aio.data_plane.tensor_payload import (
    deserialize_named_tensors,
    serialize_named_tensors,
)
from tokenspeed_aio.wire.control import ControlReply, FlushCache


async def test_a_call_resolves_once_every_replica_answered_and_combines_failures():
    calls = ControlCalls(num_replicas=2, weight_version="v0")
    call, future = calls.start(FlushCache())
    calls.received(0, [ControlReply(call.call_id, True, "cache flushed", 200, "v0")])
    await asyncio.sleep(0)
    assert not future.done()
    calls.received(1, [ControlReply(call.call_id, False, "requests hold KV blocks", 409, "v0")])
    result = await future
    assert not result.ok and result.status == 409
    assert result.message == "replica 1: requests hold KV blocks"
    call, future = calls.start(FlushCache())
    for replica in (0, 1):
        calls.received(replica, [ControlReply(call.call_id, False, "invalid", 503, "v1")])
    result = await future
    assert result.message == "invalid" and result.weight_version == "v1"


def test_each_dp_replica_publishes_on_its_own_ports():
    assert replica_endpoints("tcp://*:5557", None, 0) == ("tcp://*:5557", "tcp://*:5558")
    assert replica_endpoints("tcp://*:5557", None, 1) == ("tcp://*:5559", "tcp://*:5560")
    assert replica_endpoints("tcp://h:5557", "tcp://h:6000", 1) == ("tcp://h:5559", "tcp://h:6002")
    assert replica_endpoints("ipc:///tmp/kv", None, 1) == (
        "ipc:///tmp/kv-1",
        "ipc:///tmp/kv-replay-1",
    )


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_the_weight_payload_unpickler_resolves_only_tensor_reductions():
    named = [("w", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    torch.multiprocessing.set_sharing_strategy("file_system")
    back = deserialize_named_tensors(serialize_named_tensors(named))
    assert [n for n, _ in back] == ["w", "b"] and torch.equal(back[0][1], named[0][1])
    by_value = deserialize_named_tensors(
        serialize_named_tensors(named, "safetensors"), "safetensors"
    )
    assert torch.equal(dict(by_value)["b"], named[1][1])
    with pytest.raises(ValueError, match=r"(posix|os)\.system"):
        deserialize_named_tensors(pickle.dumps([("w", _Exploit())]))
    with pytest.raises(ValueError, match="pairs"):
        deserialize_named_tensors(pickle.dumps([1, 2]))
    with pytest.raises(ValueError, match="safetensors"):
        deserialize_named_tensors(b"junk", "safetensors")
