"""The KV-event publisher over ZMQ (``--kv-events-endpoint``): a background thread, so the
round never waits for a socket. The round hands it each drained batch (one per round, the
round's net change: Principle 5) through a bounded queue; a full queue drops the batch and
counts it. The thread numbers, encodes (vLLM's format, wire/kv_events.py) and sends each
batch on a PUB socket, keeps the last ``replay_buffer`` batches, and answers replay
requests on a ROUTER socket.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import zmq

from tokenspeed_aio.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tokenspeed_aio.wire import kv_events as wire

logger = logging.getLogger(__name__)

_END = wire.END_OF_REPLAY.to_bytes(8, "big", signed=True)
POLL_SECONDS = 0.05


def replica_endpoints(endpoint: str, replay: str | None, dp_rank: int) -> tuple[str, str]:
    """The PUB and replay endpoints of attention-DP replica ``dp_rank``: TCP ports
    ``port + 2r`` and (by default) ``port + 2r + 1``; IPC paths get ``-r`` (and ``-replay``)."""
    if endpoint.startswith("tcp://"):
        host, port = endpoint[len("tcp://") :].rsplit(":", 1)
        pub = f"tcp://{host}:{int(port) + 2 * dp_rank}"
        if replay is None:
            return pub, f"tcp://{host}:{int(port) + 2 * dp_rank + 1}"
        rhost, rport = replay[len("tcp://") :].rsplit(":", 1)
        return pub, f"tcp://{rhost}:{int(rport) + 2 * dp_rank}"
    suffix = f"-{dp_rank}" if dp_rank else ""
    return endpoint + suffix, (replay or endpoint + "-replay") + suffix


def to_wire(
    event: KVEvent, block_size: int
) -> wire.BlockStored | wire.BlockRemoved | wire.AllBlocksCleared:
    medium = getattr(event, "medium", "GPU")
    if isinstance(event, BlockStored):
        return wire.BlockStored(
            [event.block_hash], event.parent_hash, list(event.token_ids), block_size, None, medium
        )
    if isinstance(event, BlockRemoved):
        return wire.BlockRemoved([event.block_hash], medium)
    assert isinstance(event, AllBlocksCleared)
    return wire.AllBlocksCleared()


class ZmqKVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        *,
        block_size: int,
        dp_rank: int | None = None,
        queue_size: int = 10_000,
        replay_buffer: int = 10_000,
        topic: bytes = b"",
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.topic = topic
        self.dropped = 0  # batches the full queue refused
        self.sent = 0
        self._seq = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._replay_size = replay_buffer
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="ts-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise ValueError(f"kv_events_endpoint: cannot bind ({self._error})") from self._error

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one round's batch; never blocks (a full queue drops it, counted)."""
        if not events:
            return
        self._seq += 1
        try:
            self._queue.put_nowait((self._seq, time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV-event queue full: %d batches dropped", self.dropped)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (within ``timeout``), then stop."""
        self._stop.set()
        self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------------
    def _main(self) -> None:
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        replay = ctx.socket(zmq.ROUTER)
        for sock in (pub, replay):
            sock.setsockopt(zmq.LINGER, 1000)
        try:
            pub.bind(self.endpoint)
            replay.bind(self.replay_endpoint)
        except zmq.ZMQError as err:
            self._error = err
            self._ready.set()
            ctx.destroy(linger=0)
            return
        self._ready.set()
        buffer: list[tuple[int, bytes]] = []
        poller = zmq.Poller()
        poller.register(replay, zmq.POLLIN)
        try:
            while not (self._stop.is_set() and self._queue.empty()):
                try:
                    seq, ts, events = self._queue.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    events = None  # nothing to publish: serve replay requests only
                if events is not None:
                    batch = wire.KVEventBatch(
                        ts, [to_wire(e, self.block_size) for e in events], self.dp_rank
                    )
                    payload = wire.encode_batch(batch)
                    pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
                    self.sent += 1
                    buffer.append((seq, payload))
                    if len(buffer) > self._replay_size:
                        del buffer[: len(buffer) - self._replay_size]
                while poller.poll(0):
                    self._replay(replay, buffer)
        except Exception:
            logger.exception("the KV-event publisher failed")
        finally:
            ctx.destroy(linger=200)

    @staticmethod
    def _replay(sock: zmq.Socket, buffer: list[tuple[int, bytes]]) -> None:
        frames = sock.recv_multipart()
        if len(frames) < 3:
            return  # not a REQ envelope (identity, empty delimiter, start)
        identity, start = frames[0], int.from_bytes(frames[-1], "big")
        for seq, payload in buffer:
            if seq >= start:
                sock.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        sock.send_multipart([identity, b"", _END, b""])
