"""The decode side's transfer peer: one per decode rank. It looks a request's prefill
engine up at the bootstrap server the gateway named, holds the request's room at the
prefill rank of its own tp rank as soon as it is registered (a Hold: should this engine
die, that rank fails the room at once), advertises the landing pages there (a Claim), and
reports the KV and first token landing (Done). Every connection to a prefill rank
carries a heartbeat (Ping, every HEARTBEAT_SECONDS).

Cancellation (design: "PD cancellation"): a room that advertised pages is retired only
once its prefill rank acknowledged that its queued and executing writes retired
(CancelAck, or a Fail/Done, which that rank sends only when it wrote its last byte).
A failure notification or a timeout uses the same fence. When the prefill rank is
unreachable its pages stay quarantined until the rank provably stopped: a refused
connection (nothing listens on its port any more) or another instance answering
there; a transport failure alone never frees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from tokenspeed_aio.control.pd import FAILED, LANDED, RETIRED, PeerEvent
from tokenspeed_aio.pd.bootstrap import lookup
from tokenspeed_aio.pd.decode_rooms import (
    CLAIMED,
    QUARANTINED,
    REGISTERED,
    DecodeRoom,
    PrefillLink,
)
from tokenspeed_aio.pd.framing import read_frame, write_frame
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
from tokenspeed_aio.pd.peer import (
    CONNECT_SECONDS,
    HEARTBEAT_SECONDS,
    SWEEP_SECONDS,
    PeerError,
    PeerLoop,
)
from tokenspeed_aio.pd.transfer_engine import MooncakeEngine
from tokenspeed_aio.scheduler.plan import RemotePrefill
from tokenspeed_aio.wire.messages import Bootstrap

logger = logging.getLogger(__name__)

PROBE_SECONDS = 0.5  # how often a lost prefill rank is probed for proof that it stopped
RETIRE_GRACE_SECONDS = 0.5  # after that proof, for bytes already in the receiving socket


class DecodePeer(PeerLoop):
    role = "decode"

    def __init__(
        self,
        *,
        engine: MooncakeEngine,
        layout: KvLayout,
        tp_rank: int,
        instance: int,
        timeout: float,
    ) -> None:
        super().__init__("ts-pd")
        self.engine = engine  # the write target: its pool is registered there
        self.session = engine.session
        self.layout = layout
        self.tp_rank = tp_rank
        self.instance = instance
        self.timeout = timeout
        self._rooms: dict[str, DecodeRoom] = {}
        self._rosters: dict[tuple[str, int], list[RankEndpoint]] = {}
        self._links: dict[tuple[str, int, int], PrefillLink] = {}
        self._connecting: dict[tuple[str, int], asyncio.Future[PrefillLink]] = {}
        self.call(self._start)

    def _start(self) -> None:
        self.spawn(self._sweep())

    # -- from the control plane ---------------------------------------------------------
    def _register(self, rid: str, bootstrap: Bootstrap) -> None:
        room = self._rooms[rid] = DecodeRoom(rid, bootstrap)
        self.spawn(self._attach(room))

    def _cancel(self, rid: str) -> None:
        room = self._rooms.get(rid)
        if room is None or room.cancelled:
            return
        room.cancelled = True
        self._stop(room)

    # -- from the forward thread ------------------------------------------------------
    def stage(self, entries: list[RemotePrefill], fence: Callable[[], None] | None) -> None:
        """A plan's landing pages; ``fence`` waits until every forward dispatched before
        them finished on the device (the prefill ranks' writes are not ordered with it)."""
        self.call(self._stage, entries, fence)

    def _stage(self, entries: list[RemotePrefill], fence: Callable[[], None] | None) -> None:
        if fence is not None:
            self.spawn(self._stage_after(entries, fence))
            return
        for entry in entries:
            room = self._rooms.get(entry.rid)
            if room is None or room.state != REGISTERED or room.cancelled:
                continue  # cancelled or failed meanwhile: nothing is advertised
            room.pages = list(entry.block_ids)
            if room.link is not None:
                self._claim(room)

    async def _stage_after(self, entries: list[RemotePrefill], fence: Callable[[], None]) -> None:
        await self.loop.run_in_executor(None, fence)
        self._stage(entries, None)

    # -- the room's life ----------------------------------------------------------------
    async def _attach(self, room: DecodeRoom) -> None:
        try:
            link = await self._link_for(room.where)
        except PeerError as err:
            self._fail(room, err.status, err.message)
            self._retire(room)
            ranks = self._rosters.get(room.where)
            if ranks and self.tp_rank < len(ranks):  # it may drop its half at once
                self.spawn(self._send_cancel(ranks[self.tp_rank], room.room))
            return
        if self._rooms.get(room.rid) is not room:
            return  # cancelled (and retired) while looking up
        room.link = link
        link.rooms[room.room] = room
        if room.cancelled:
            self._stop(room)
        elif room.pages is not None:
            self._claim(room)
        else:
            link.send(Hold(room.room))  # the room is this connection's from here on

    def _claim(self, room: DecodeRoom) -> None:
        room.state = CLAIMED
        room.claimed = time.monotonic()
        room.link.send(Claim(room.room, room.pages))

    def _stop(self, room: DecodeRoom) -> None:
        """Cancel a room: retire it now if it never advertised pages, else once its
        prefill rank acknowledged (or proved it stopped)."""
        if room.state == REGISTERED:
            if room.link is not None:
                room.link.send(Cancel(room.room))  # lets the prefill rank drop it early
            self._retire(room)
        elif room.state == CLAIMED:
            room.link.send(Cancel(room.room))
        # QUARANTINED: waits for the proof

    def _fail(self, room: DecodeRoom, status: int, message: str) -> None:
        if not room.failed and not room.cancelled:
            room.failed = True
            self.emit(PeerEvent(room.rid, FAILED, status=status, message=message))

    def _retire(self, room: DecodeRoom, event: PeerEvent | None = None) -> None:
        if self._rooms.get(room.rid) is room:
            del self._rooms[room.rid]
        if room.link is not None:
            room.link.rooms.pop(room.room, None)
        self.emit(event or PeerEvent(room.rid, RETIRED))

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            now = time.monotonic()
            for room in list(self._rooms.values()):
                late = room.state in (REGISTERED, CLAIMED) and now - room.created > self.timeout
                if late and not room.cancelled:
                    where = f"{room.where[0]}:{room.where[1]}"
                    self._fail(
                        room,
                        503,
                        f"no KV arrived from the prefill engine at {where} within "
                        f"{self.timeout:g} s",
                    )
                    room.cancelled = True
                    self._stop(room)
            pages = sum(len(r.pages or ()) for r in self._rooms.values() if r.state == QUARANTINED)
            self._gauges = (0, pages)

    # -- links to prefill ranks ---------------------------------------------------------
    async def _link_for(self, where: tuple[str, int]) -> PrefillLink:
        ranks = self._rosters.get(where)
        if ranks is None:
            ranks = await lookup(*where)
            self._rosters[where] = ranks
        if len(ranks) != self.layout.tp_size:
            raise PeerError(
                400,
                f"unequal tensor parallelism: the prefill engine at {where[0]}:{where[1]} "
                f"runs tp={len(ranks)}, this decode engine tp={self.layout.tp_size}; PD "
                "transfers need the same tp on both sides",
            )
        endpoint = ranks[self.tp_rank]
        problem = self.layout.mismatch(endpoint.layout)
        if problem is not None:
            raise PeerError(400, f"the prefill engine at {where[0]}:{where[1]}: {problem}")
        key = (endpoint.host, endpoint.port, endpoint.instance)
        link = self._links.get(key)
        if link is not None and link.alive:
            return link
        pending = self._connecting.get(where)
        if pending is None:
            pending = self._connecting[where] = self.loop.create_future()
            try:
                link = await self._open(endpoint, where)
                self._links[key] = link
                pending.set_result(link)
            except PeerError as err:
                self._rosters.pop(where, None)
                pending.set_exception(err)
            finally:
                del self._connecting[where]
        return await asyncio.shield(pending)

    async def _connect(self, endpoint: RankEndpoint):
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(endpoint.host, endpoint.port), timeout=CONNECT_SECONDS
        )
        hello = Hello(self.instance, self.tp_rank, self.session, self.layout, CONTROL_VERSION)
        write_frame(writer, hello)
        await writer.drain()
        welcome = await asyncio.wait_for(read_frame(reader, "control"), CONNECT_SECONDS)
        if not isinstance(welcome, Welcome):
            writer.close()
            raise ConnectionError("not a prefill transfer peer")
        return reader, writer, welcome

    async def _send_cancel(self, endpoint: RankEndpoint, room: int) -> None:
        """Tell a prefill rank this decode rank cannot take (another layout) to drop a
        room, instead of leaving it to its timeout; nothing was advertised to it."""
        with contextlib.suppress(OSError, ConnectionError, TimeoutError):
            reader, writer, _ = await self._connect(endpoint)
            write_frame(writer, Cancel(room))
            await writer.drain()
            await asyncio.wait_for(read_frame(reader, "control"), CONNECT_SECONDS)
            writer.close()

    async def _open(self, endpoint: RankEndpoint, where: tuple[str, int]) -> PrefillLink:
        link = PrefillLink(endpoint, where)
        try:
            reader, writer, welcome = await self._connect(endpoint)
        except (OSError, ConnectionError, TimeoutError) as err:
            raise PeerError(503, f"cannot reach the prefill rank at {link.name}: {err}") from err
        if welcome.error is not None:
            writer.close()
            raise PeerError(400, f"the prefill rank at {link.name} refused: {welcome.error}")
        if welcome.version != CONTROL_VERSION:
            writer.close()
            raise PeerError(
                400,
                f"the prefill engine at {link.name} speaks PD control protocol "
                f"{welcome.version}, this decode engine {CONTROL_VERSION}: run the same "
                "tokenspeed_aio version on both sides",
            )
        if welcome.instance != endpoint.instance:
            writer.close()
            raise PeerError(503, f"the prefill engine at {link.name} restarted")
        link.writer, link.alive = writer, True
        self._serve_link(link, reader, writer)
        return link

    def _serve_link(
        self, link: PrefillLink, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.spawn(self._read(link, reader))
        self.spawn(self._heartbeat(link, writer))

    async def _heartbeat(self, link: PrefillLink, writer: asyncio.StreamWriter) -> None:
        """Ping the prefill rank while this connection of the link lasts."""
        while link.alive and link.writer is writer:
            link.send(Ping())
            await asyncio.sleep(HEARTBEAT_SECONDS)

    async def _read(self, link: PrefillLink, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                self._on_message(link, await read_frame(reader, "control"))
        except (ConnectionError, OSError) as err:
            logger.warning("lost the prefill rank at %s: %s", link.name, err)
        finally:
            self._lost(link)

    def _on_message(self, link: PrefillLink, msg) -> None:
        room = link.rooms.get(msg.room)
        if room is None:
            return  # a repeated acknowledgment, or a room already retired
        if isinstance(msg, Done):
            if room.cancelled or room.failed:
                self._retire(room)  # its writes completed: the pages are safe
            else:
                self._retire(
                    room,
                    PeerEvent(
                        room.rid,
                        LANDED,
                        token=msg.token,
                        logprobs=msg.logprobs,
                        num_bytes=msg.num_bytes,
                        seconds=time.monotonic() - room.claimed,  # pages advertised -> KV in
                    ),
                )
        elif isinstance(msg, Fail):
            self._fail(room, msg.status, f"the prefill engine: {msg.message}")
            self._retire(room)
        elif isinstance(msg, CancelAck):
            self._retire(room)

    def _lost(self, link: PrefillLink) -> None:
        """The prefill rank's connection is gone: its rooms fail; those that advertised
        pages keep them until the rank provably stopped."""
        link.alive = False
        if link.writer is not None:
            link.writer.close()
        self._links.pop((link.endpoint.host, link.endpoint.port, link.endpoint.instance), None)
        self._rosters.pop(link.where, None)
        quarantined = False
        for room in list(link.rooms.values()):
            self._fail(room, 503, f"lost the prefill engine at {link.name}")
            if room.state == REGISTERED:
                self._retire(room)
            else:
                room.state = QUARANTINED
                quarantined = True
        if quarantined:
            self.spawn(self._prove_stopped(link))

    async def _prove_stopped(self, link: PrefillLink) -> None:
        """Retire a lost rank's quarantined rooms once it provably writes no more."""
        while link.rooms:
            try:
                reader, writer, welcome = await self._connect(link.endpoint)
            except ConnectionRefusedError:
                break  # nothing listens there: the rank exited
            except (OSError, ConnectionError, TimeoutError):
                await asyncio.sleep(PROBE_SECONDS)  # unreachable proves nothing
                continue
            if welcome.instance != link.endpoint.instance:
                writer.close()
                break  # another start holds its port: the old one exited
            # The same rank, reachable again: cancel through it and wait for its answers.
            link.writer, link.alive = writer, True
            for room in link.rooms.values():
                room.state = CLAIMED
                room.cancelled = True
                link.send(Cancel(room.room))
            self._serve_link(link, reader, writer)
            return
        await asyncio.sleep(RETIRE_GRACE_SECONDS)
        for room in list(link.rooms.values()):
            self._retire(room)

    async def _aclose(self) -> None:
        for link in list(self._links.values()):
            if link.writer is not None:
                link.writer.close()
                with contextlib.suppress(Exception):
                    await link.writer.wait_closed()
        await super()._aclose()
        self.engine.close()
