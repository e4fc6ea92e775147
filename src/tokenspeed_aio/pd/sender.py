"""The prefill side's transfer peer: one per prefill rank. Its control server takes the
decode ranks' holds (a room's request registered there) and claims (its landing pages);
once its own request for the room finished its prompt (the plan's RemoteDecode), a
write worker writes the prompt's pages into the decode rank's pool with Mooncake and
the rank sends Done with the first token.

A decode rank's liveness is its control connection: it pings every HEARTBEAT_SECONDS,
and when the connection drops or HEARTBEAT_LAPSE_SECONDS pass without a frame, every
room it held or claimed fails at once. A room no decode rank ever held waits for
``--disaggregation-bootstrap-timeout``; but for that long after a decode connection was
lost (the gateway may still send that engine's half of new requests), such a room fails
once HOLD_SECONDS passed without a hold: a live decode engine holds its room as soon as
it admits the request.

Source retirement (design: "PD source retirement"): a terminal status alone never
frees the source pages. Queued jobs of a failed or cancelled room are dropped,
executing ones return from the synchronous write first; only then does the room
report RETIRED (and answer the decode rank: CancelAck, or Fail). A cancelled room
leaves a tombstone, so a late registration or claim cannot revive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from tokenspeed_aio.control.pd import FAILED, RETIRED, PeerEvent
from tokenspeed_aio.pd.bootstrap import BootstrapServer, register_rank
from tokenspeed_aio.pd.framing import read_frame, write_frame
from tokenspeed_aio.pd.layout import write_plan
from tokenspeed_aio.pd.messages import (
    CONTROL_VERSION,
    Cancel,
    CancelAck,
    Claim,
    Done,
    Fail,
    Hello,
    Hold,
    KvLayout,
    Ping,
    RankEndpoint,
    Welcome,
)
from tokenspeed_aio.pd.peer import HEARTBEAT_LAPSE_SECONDS, SWEEP_SECONDS, PeerLoop
from tokenspeed_aio.pd.prefill_rooms import (
    DONE,
    QUEUED,
    WAITING,
    DecodeConnection,
    Room,
    refusal,
)
from tokenspeed_aio.pd.transfer_engine import MooncakeEngine
from tokenspeed_aio.scheduler.plan import RemoteDecode
from tokenspeed_aio.wire.messages import Bootstrap

logger = logging.getLogger(__name__)

NUM_WRITERS = 2  # write worker threads (each write blocks in Mooncake, the GIL released)
# Fault injection for the tests: every write waits this long first, so a test can cancel
# or kill an engine while transfers are executing.
WRITE_DELAY_ENV = "TOKENSPEED_PD_WRITE_DELAY"
# After a decode connection was lost: how long a room may wait for any decode rank's hold.
HOLD_SECONDS = 3.0
LOST = "lost the decode engine's connection"
CANCELLED = "this transfer was cancelled"


class PrefillPeer(PeerLoop):
    role = "prefill"

    def __init__(
        self,
        *,
        engine: MooncakeEngine,
        layout: KvLayout,
        tp_rank: int,
        instance: int,
        timeout: float,
        host: str,
        bootstrap: tuple[str, int],
        serve_bootstrap: bool,
    ) -> None:
        super().__init__("ts-pd")
        self.engine = engine
        self.layout = layout
        self.tp_rank = tp_rank
        self.instance = instance
        self.timeout = timeout
        self._rooms: dict[int, Room] = {}
        self._by_rid: dict[str, Room] = {}
        # a stopped room -> (when it may be forgotten, what a late registration is told)
        self._tombstones: dict[int, tuple[float, int, str]] = {}
        self._suspect_until = 0.0  # unheld rooms fail after HOLD_SECONDS until then
        self._jobs: queue.SimpleQueue[Room | None] = queue.SimpleQueue()
        self._writers = [
            threading.Thread(target=self._write_main, name=f"ts-pd-write-{i}", daemon=True)
            for i in range(NUM_WRITERS)
        ]
        for thread in self._writers:
            thread.start()
        self._bootstrap = BootstrapServer(layout.tp_size) if serve_bootstrap else None
        self._write_delay = float(os.environ.get(WRITE_DELAY_ENV, "0"))
        self.run(self._start(host, bootstrap), timeout=timeout + 30)

    async def _start(self, host: str, bootstrap: tuple[str, int]) -> None:
        if self._bootstrap is not None:
            await self._bootstrap.start(bootstrap[0], bootstrap[1])
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        endpoint = RankEndpoint(
            self.tp_rank, host, port, self.engine.session, self.instance, self.layout
        )
        await register_rank(*bootstrap, endpoint, timeout=self.timeout)
        self.spawn(self._sweep())

    # -- from the control plane ---------------------------------------------------------
    def _register(self, rid: str, bootstrap: Bootstrap) -> None:
        room = bootstrap.room
        if room in self._tombstones:
            _, status, message = self._tombstones[room]
            self._fail_new(rid, status, message)
            return
        send = self._rooms.get(room)
        if send is None:
            send = self._rooms[room] = Room(room, rid)
        elif send.rid is not None:
            self._fail_new(rid, 409, f"bootstrap room {room} is already in use by another request")
            return
        send.rid = rid
        send.created = time.monotonic()  # now the claim's wait starts
        self._by_rid[rid] = send
        self._maybe_start(send)

    def _fail_new(self, rid: str, status: int, message: str) -> None:
        self.emit(PeerEvent(rid, FAILED, status=status, message=message))
        self.emit(PeerEvent(rid, RETIRED))

    def _cancel(self, rid: str) -> None:
        send = self._by_rid.get(rid)
        if send is not None and not send.cancelled:
            self._stop(send)

    # -- from the forward thread --------------------------------------------------------
    def stage(self, entries: list[RemoteDecode], fence: Callable[[], None] | None) -> None:
        """A plan's finished prompts (their KV is complete: their results landed)."""
        self.call(self._stage, entries)

    def _stage(self, entries: list[RemoteDecode]) -> None:
        for entry in entries:
            send = self._by_rid.get(entry.rid)
            if send is not None and not send.cancelled:
                send.stream = entry
                self._maybe_start(send)

    # -- the room's life ----------------------------------------------------------------
    def _maybe_start(self, send: Room) -> None:
        if send.state != WAITING or send.cancelled:
            return
        if send.stream is None or send.pages is None or send.rid is None:
            return
        if len(send.pages) != len(send.stream.block_ids):
            self._fail(
                send,
                400,
                f"the decode engine offered {len(send.pages)} pages for "
                f"{len(send.stream.block_ids)} of KV",
            )
            self._stop(send)
            return
        send.state = QUEUED
        self._jobs.put(send)

    def _write_main(self) -> None:
        while (send := self._jobs.get()) is not None:
            if send.cancelled:  # dropped: never started
                self.call(self._written, send, None, 0, 0.0)
                continue
            sources, targets, lengths = write_plan(
                self.layout, send.conn.hello.layout, send.stream.block_ids, send.pages
            )
            if self._write_delay:
                time.sleep(self._write_delay)
                if send.cancelled:  # cancelled while it waited: it never starts
                    self.call(self._written, send, None, 0, 0.0)
                    continue
            start = time.perf_counter()
            try:
                rc = self.engine.write(send.conn.hello.session, sources, targets, lengths)
            except Exception as err:  # a write that raised is retired like a failed one
                logger.error("KV write of room %d raised: %r", send.room, err)
                rc = -1
            self.call(self._written, send, rc, sum(lengths), time.perf_counter() - start)

    def _written(self, send: Room, rc: int | None, num_bytes: int, seconds: float) -> None:
        """A job retired (rc None: dropped before it started)."""
        send.state = DONE
        if send.cancelled:
            self._finish(send, ok=False)
        elif rc == 0:
            stream = send.stream
            done = Done(send.room, stream.first_token, stream.first_logprobs, num_bytes, seconds)
            send.conn.send(done)
            self._finish(send, ok=True, num_bytes=num_bytes, seconds=seconds)
        else:
            message = f"writing the KV to the decode engine failed (Mooncake returned {rc})"
            self._fail(send, 503, message)
            send.reason = message
            self._finish(send, ok=False)

    def _fail(self, send: Room, status: int, message: str) -> None:
        if send.rid is not None and not send.failed:
            send.failed = True
            self.emit(PeerEvent(send.rid, FAILED, status=status, message=message))

    def _stop(self, send: Room, status: int = 409, message: str = CANCELLED) -> None:
        """Cancel a room; it retires now if no job of it is queued or executing, else
        when the job returns. ``status`` and ``message``: what a registration of the
        room that comes later is told."""
        send.cancelled = True
        self._bury(send.room, status, message)
        if send.state == WAITING:
            self._finish(send, ok=False)

    def _bury(self, room: int, status: int, message: str) -> None:
        self._tombstones[room] = (time.monotonic() + 2 * self.timeout, status, message)

    def _finish(self, send: Room, *, ok: bool, num_bytes: int = 0, seconds: float = 0.0) -> None:
        """The room retired: answer its decode rank (a Done went out already on success),
        forget it, and report it."""
        send.state = DONE
        if send.conn is not None and not ok:
            send.conn.send(
                CancelAck(send.room) if send.peer_cancelled else Fail(send.room, 503, send.reason)
            )
        if self._rooms.get(send.room) is send:
            del self._rooms[send.room]
        if send.conn is not None:
            send.conn.rooms.discard(send.room)
        if send.rid is not None and self._by_rid.get(send.rid) is send:
            del self._by_rid[send.rid]
            self.emit(PeerEvent(send.rid, RETIRED, ok=ok, num_bytes=num_bytes, seconds=seconds))

    # -- decode ranks ---------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = None
        try:
            hello = await asyncio.wait_for(read_frame(reader, "control"), 30)
            if not isinstance(hello, Hello):
                return
            problem = refusal(self.layout, self.tp_rank, hello)
            write_frame(writer, Welcome(self.instance, problem, CONTROL_VERSION))
            await writer.drain()
            conn = DecodeConnection(writer, hello)
            while True:
                try:
                    msg = await asyncio.wait_for(
                        read_frame(reader, "control"), HEARTBEAT_LAPSE_SECONDS
                    )
                except TimeoutError:
                    logger.warning(
                        "no frame from decode rank %d (%s) for %g s: taken for dead",
                        hello.tp_rank,
                        hello.session,
                        HEARTBEAT_LAPSE_SECONDS,
                    )
                    conn.reason = f"no heartbeat for {HEARTBEAT_LAPSE_SECONDS:g} s"
                    return
                if isinstance(msg, Cancel):  # taken even from a rank it refused
                    self._on_cancel(conn, msg.room)
                elif problem is None and isinstance(msg, (Hold, Claim, Ping)):
                    conn.serving = True
                    if isinstance(msg, Hold):
                        self._on_hold(conn, msg.room, None)
                    elif isinstance(msg, Claim):
                        self._on_hold(conn, msg.room, msg.pages)
                await writer.drain()
        except (ConnectionError, OSError, TimeoutError) as err:  # _lost fails its rooms
            logger.debug("decode control connection closed: %s", err)
        finally:
            if conn is not None:
                self._lost(conn)
            writer.close()

    def _on_hold(self, conn: DecodeConnection, room: int, pages: list[int] | None) -> None:
        """A Hold (``pages`` None) or a Claim: the room is this connection's."""
        if room in self._tombstones:
            conn.send(Fail(room, 503, CANCELLED))
            return
        send = self._rooms.get(room)
        if send is None:  # the decode side was first: the room waits for its request here
            send = self._rooms[room] = Room(room, None)
        elif (send.conn is not None and send.conn is not conn) or send.pages is not None:
            conn.send(Fail(room, 409, f"room {room} was already claimed"))
            return
        send.conn = conn
        conn.rooms.add(room)
        if pages is not None:
            send.pages = pages
            self._maybe_start(send)

    def _on_cancel(self, conn: DecodeConnection, room: int) -> None:
        send = self._rooms.get(room)
        self._bury(room, 409, CANCELLED)
        if send is None:
            conn.send(CancelAck(room))  # unknown, or retired already: nothing writes
            return
        send.conn = send.conn or conn
        send.peer_cancelled = True  # its CancelAck goes out once its job returned
        if not send.cancelled:
            self._fail(send, 503, "the decode engine cancelled the transfer")
            self._stop(send)

    def _lost(self, conn: DecodeConnection) -> None:
        """A decode rank is gone: the rooms it held or claimed fail and retire once their
        jobs returned, so the source pages are released; for the bootstrap timeout, a
        room no decode rank holds fails after HOLD_SECONDS."""
        conn.alive = False
        if conn.serving:
            self._suspect_until = time.monotonic() + self.timeout
        message = f"{LOST} ({conn.reason})" if conn.reason else LOST
        for room in list(conn.rooms):
            send = self._rooms.get(room)
            if send is not None and not send.cancelled:
                self._fail(send, 503, message)
                send.reason = message
                self._stop(send, 503, message)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            now = time.monotonic()
            for send in list(self._rooms.values()):
                if send.cancelled or send.state != WAITING:
                    continue
                age = now - send.created
                if send.rid is None and age >= self.timeout:  # held, request never came
                    message = (
                        f"the prefill engine did not receive room {send.room}'s request "
                        f"within {self.timeout:g} s"
                    )
                    send.conn.send(Fail(send.room, 503, message))
                    send.conn.rooms.discard(send.room)
                    del self._rooms[send.room]
                    self._bury(send.room, 503, message)
                elif send.rid is None or send.pages is not None:
                    continue  # the request or the prefill still to come
                elif age >= self.timeout:
                    message = f"no decode engine claimed room {send.room} within {self.timeout:g} s"
                    self._fail(send, 503, message)
                    send.reason = message
                    self._stop(send, 503, message)
                elif send.conn is None and age >= HOLD_SECONDS and now < self._suspect_until:
                    message = (
                        f"no decode engine took room {send.room} within {HOLD_SECONDS:g} s "
                        "after this prefill engine lost a decode engine (the request's "
                        "decode half may have gone to it)"
                    )
                    self._fail(send, 503, message)
                    self._stop(send, 503, message)
            for room in [r for r, (t, _, _) in self._tombstones.items() if t < now]:
                del self._tombstones[room]
            unclaimed = sum(1 for s in self._rooms.values() if s.rid is None)
            self._gauges = (unclaimed, 0)

    async def _aclose(self) -> None:
        for _ in self._writers:
            self._jobs.put(None)
        if self._bootstrap is not None:
            await self._bootstrap.close()
        self._server.close()
        await super()._aclose()
        with contextlib.suppress(Exception):
            self.engine.close()
