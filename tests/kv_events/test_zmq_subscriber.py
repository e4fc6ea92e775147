"""An external subscriber of the ZMQ KV-event stream (a SUB socket, and the replay
ROUTER through a DEALER) rebuilds the set of cached blocks; after a mixed workload with
evictions and a flush it equals the scheduler's prefix cache."""

from __future__ import annotations

import asyncio
import threading
import time

import zmq
from helpers.generation import final_outputs

from tokenspeed_aio.bench.ports import free_port
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.wire.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
)


class Subscriber(threading.Thread):
    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.batches: dict[int, object] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while not self.stop.is_set():
            if poller.poll(50):
                _topic, seq, payload = self.sub.recv_multipart()
                self.batches[int.from_bytes(seq, "big")] = decode_batch(payload)

    def replay(self, endpoint: str, start: int) -> dict[int, object]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = {}
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == END_OF_REPLAY:
                break
            got[seq] = decode_batch(payload)
        dealer.close(0)
        return got


def rebuild(batches: dict[int, object]) -> set[int]:
    cached: set[int] = set()
    for seq in sorted(batches):
        for event in batches[seq].events:
            if isinstance(event, BlockStored):
                assert event.block_size == 4 and event.medium == "GPU"
                assert len(event.token_ids) == 4 * len(event.block_hashes)
                cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                cached.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                cached.clear()
    return cached


async def test_a_subscriber_rebuilds_the_prefix_cache(ckpt, start_engine):
    port = free_port()
    engine = await start_engine(
        ckpt("llama"), page_size=4, num_kv_blocks=40, kv_events_endpoint=f"tcp://127.0.0.1:{port}"
    )
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    sub.start()
    await asyncio.sleep(0.3)  # the SUB socket's subscription reaches the publisher
    publisher = engine._backend.rank.kv_publisher
    scheduler = engine.control_loop.scheduler
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    shared = list(range(100, 116))  # four blocks every prompt of a wave shares
    waves = [
        [shared + [200 + 10 * w + i] * (5 + 3 * i) for i in range(5)] for w in range(3)
    ]  # 39 usable blocks: the waves evict each other's blocks
    for wave in waves[:2]:
        await final_outputs(engine, wave, params)
    await engine.wait_idle()
    await engine.flush_cache()
    await final_outputs(engine, waves[2], params)
    await engine.wait_idle()
    deadline = time.monotonic() + 10
    while publisher.sent < publisher._seq or len(sub.batches) < publisher.sent:
        assert time.monotonic() < deadline, (publisher.sent, publisher._seq, len(sub.batches))
        await asyncio.sleep(0.02)
    sub.stop.set()
    sub.join()
    assert publisher.dropped == 0
    assert sorted(sub.batches) == list(range(1, publisher._seq + 1))  # no gap
    events = [e for b in sub.batches.values() for e in b.events]
    assert any(isinstance(e, BlockRemoved) for e in events)
    assert any(isinstance(e, AllBlocksCleared) for e in events)
    cached = scheduler.cached_block_hashes()
    assert cached and rebuild(sub.batches) == cached
    replayed = sub.replay(f"tcp://127.0.0.1:{port + 1}", start=1)
    assert sorted(replayed) == sorted(sub.batches)
    assert rebuild(replayed) == cached
    sub.ctx.destroy(0)
