"""The load report: sent with every output batch, when the load changed even without
outputs, and an unchanged idle load at most once a heartbeat (how the frontend tells a
live engine from a stale one); the planned rounds counted by their tokens ride it."""

from __future__ import annotations

import asyncio
import types

import msgspec
import pytest
from helpers.sim_engine import SimEngine

from tokenspeed_aio.control import event_loop as event_loop_module
from tokenspeed_aio.control import transport as transport_module
from tokenspeed_aio.control.transport import HEARTBEAT_SECONDS, LoadReporter
from tokenspeed_aio.wire.messages import ITERATION_TOKEN_BUCKETS, Load, TokenOutput

NO_ROUNDS = (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
IDLE = Load(running=0, waiting=0, resident_blocks=3, active_blocks=0, total_blocks=16,
            iteration_buckets=NO_ROUNDS)  # fmt: skip
BUSY = msgspec.structs.replace(IDLE, running=1, resident_blocks=4, active_blocks=1)


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(transport_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_outputs_are_sent_with_the_load_every_round(clock):
    reporter = LoadReporter(replica=2)
    for _ in range(3):
        out = [TokenOutput("a", [7])]
        batch = reporter.batch(out, BUSY)
        assert batch is not None and batch.outputs == out
        assert (batch.load, batch.replica) == (BUSY, 2)


def test_a_changed_load_is_sent_without_outputs(clock):
    reporter = LoadReporter()
    assert reporter.batch([], BUSY).load == BUSY  # the first report
    assert reporter.batch([], IDLE).load == IDLE  # a cancelled request ended: no token
    assert reporter.batch([], BUSY).load == BUSY


def test_an_unchanged_idle_load_is_sent_at_most_once_a_heartbeat(clock):
    reporter = LoadReporter()
    assert reporter.batch([], IDLE) is not None
    clock[0] += HEARTBEAT_SECONDS * 0.9
    assert reporter.batch([], IDLE) is None
    assert reporter.batch([], IDLE) is None
    clock[0] += HEARTBEAT_SECONDS * 0.1
    heartbeat = reporter.batch([], IDLE)
    assert heartbeat is not None and heartbeat.outputs == [] and heartbeat.load == IDLE
    assert reporter.batch([], IDLE) is None  # the heartbeat restarted the interval
    clock[0] += HEARTBEAT_SECONDS * 0.5
    assert reporter.batch([TokenOutput("a", [1])], IDLE) is not None
    clock[0] += HEARTBEAT_SECONDS * 0.6
    assert reporter.batch([], IDLE) is None  # counted from the last batch sent


def test_the_data_planes_jit_counts_ride_the_load(clock):
    reporter = LoadReporter()
    batch = reporter.batch([], IDLE, (2, 0.5))
    assert (batch.load.jit_compiles, batch.load.jit_compile_seconds) == (2, 0.5)
    assert reporter.batch([], IDLE, (2, 0.5)) is None
    assert reporter.batch([], IDLE, (3, 0.7)).load.jit_compiles == 3  # a change is news


def test_planned_rounds_are_counted_by_their_tokens_and_alone_are_not_news(clock):
    reporter = LoadReporter()
    assert reporter.batch([], IDLE).load.iteration_buckets == NO_ROUNDS
    for tokens in (0, 1, 1, 2, 8, 9, 16384, 16385, 99999):  # 0: a plan with no batch
        reporter.planned(tokens)
    assert reporter.batch([], IDLE) is None  # only the histogram moved
    clock[0] += HEARTBEAT_SECONDS
    counts = reporter.batch([], IDLE).load.iteration_buckets
    # le=1: two, le=8: two (2 and 8), le=16: one (9), le=16384: one, +Inf: two
    assert counts == (2, 2, 1, *[0] * 9, 1, 2)


async def test_an_idle_loop_sends_one_heartbeat_a_heartbeat(monkeypatch):
    heartbeat = 0.02
    monkeypatch.setattr(transport_module, "HEARTBEAT_SECONDS", heartbeat)
    monkeypatch.setattr(event_loop_module, "HEARTBEAT_SECONDS", heartbeat)
    engine = SimEngine()
    task = asyncio.create_task(engine.loop.run())
    await asyncio.sleep(heartbeat * 15)
    await engine.transport.close()
    await asyncio.wait_for(task, 5)
    engine.collect()
    assert all(b.outputs == [] for b in engine.batches)
    # Not a busy loop: at most one a heartbeat (plus the first); and it does beat.
    assert 3 <= len(engine.batches) <= 16
