"""The rendezvous: how ranks on any hosts learn every rank's mesh address.

Rank 0 serves it at the launcher's ``--dist-init-addr``. Every rank, rank 0 included, binds its
mesh listener to a port the OS picks, registers that (host, port) there and receives the full
table in rank order; then the mesh forms over that table as over an explicit one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec

from tokenspeed_aio.collective.connection import FrameConnection
from tokenspeed_aio.collective.errors import FormationError
from tokenspeed_aio.collective.formation import close_all, open_retrying
from tokenspeed_aio.collective.framing import Register, Roster, encode_frame


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0 serves at (``host``, ``port``), every rank registers there.

    ``local_host`` is this rank's address as its peers dial it; by default the address of the
    interface that reaches ``host`` (so one ``--dist-init-addr`` serves every node).
    """

    host: str
    port: int
    local_host: str | None = None

    @classmethod
    def parse(cls, address: str, local_host: str | None = None) -> Rendezvous:
        """From ``HOST:PORT`` (``[V6ADDR]:PORT`` for IPv6), as ``--dist-init-addr`` gives it."""
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"a rendezvous address is HOST:PORT, got {address!r}")
        return cls(host.removeprefix("[").removesuffix("]"), int(port), local_host)


class RendezvousServer:
    """Rank 0's registry: collects every rank's address, then sends each rank the table.

    Registrations are handled in the connections' callbacks; no task serves them.
    """

    def __init__(self, world_size: int, job_id: str):
        self.world_size = world_size
        self.job_id = job_id
        self._entries: dict[int, tuple[Register, FrameConnection]] = {}
        self._unregistered: set[FrameConnection] = set()
        # Why the rendezvous failed, told to ranks that register after it did.
        self._failure: str | None = None
        self._finished = False
        self._server: asyncio.Server | None = None

    @classmethod
    async def start(cls, host: str, port: int, world_size: int, job_id: str) -> RendezvousServer:
        server = cls(world_size, job_id)
        loop = asyncio.get_running_loop()
        try:
            server._server = await loop.create_server(server._connection, host, port)
        except OSError as exc:
            raise FormationError(
                f"rank 0 cannot serve the rendezvous on {host}:{port}: {exc}"
            ) from exc
        return server

    def _connection(self) -> FrameConnection:
        connection = FrameConnection()
        self._unregistered.add(connection)
        connection.receive(lambda body: self._register(connection, body))
        return connection

    def _register(self, connection: FrameConnection, body: bytes) -> None:
        connection.receive(None)
        self._unregistered.discard(connection)
        try:
            entry = msgspec.msgpack.decode(body, type=Register)
        except msgspec.DecodeError:
            # Not a rank (a port probe, a stray client): the rendezvous waits on the ranks.
            connection.close_soon()
            return
        reason = self._reject_reason(entry)
        if reason is not None:
            # Fail every rank now, with the reason, rather than at the formation timeout.
            self._failure = self._failure or f"the rendezvous rejected rank {entry.rank}: {reason}"
            self._answer(Roster([], self._failure))
            self._answer_one(connection, Roster([], self._failure))
            return
        self._entries[entry.rank] = (entry, connection)
        if len(self._entries) == self.world_size:
            ranks = sorted(self._entries)
            table = [(self._entries[r][0].host, self._entries[r][0].port) for r in ranks]
            self._answer(Roster(table))

    def _reject_reason(self, entry: Register) -> str | None:
        if self._finished:
            return "the rendezvous already completed"
        if entry.job_id != self.job_id:
            return f"it belongs to job {entry.job_id!r}, the rendezvous to {self.job_id!r}"
        if entry.world_size != self.world_size:
            return f"its world size is {entry.world_size}, rank 0's is {self.world_size}"
        if not 0 <= entry.rank < self.world_size:
            return f"rank {entry.rank} is outside the world of {self.world_size} ranks"
        if entry.rank in self._entries:
            return f"rank {entry.rank} already registered"
        return None

    def _answer(self, roster: Roster) -> None:
        """Send ``roster`` to every registered rank, then hang up; the rendezvous is over."""
        self._finished = True
        for _, connection in self._entries.values():
            self._answer_one(connection, roster)
        self._entries.clear()

    @staticmethod
    def _answer_one(connection: FrameConnection, roster: Roster) -> None:
        connection.send(encode_frame(roster))
        connection.close_soon()  # after the roster is sent

    async def close(self) -> None:
        """Stop serving; ranks still waiting for the table are told it will not come."""
        if self._server is not None:
            self._server.close()
        if self._entries:
            self._answer(Roster([], "the rendezvous closed before every rank registered"))
        leftover = list(self._unregistered)
        self._unregistered.clear()
        await close_all(leftover)


class RendezvousClient:
    """One rank's registration: dial the rendezvous, trade this rank's address for the table."""

    def __init__(self, connection: FrameConnection):
        self._connection = connection
        assert connection.transport is not None
        # The interface this host reaches the rendezvous through is one its peers can reach.
        self.local_host: str = connection.transport.get_extra_info("sockname")[0]

    @classmethod
    async def dial(
        cls, rendezvous: Rendezvous, rank: int, deadline: float, timeout: float
    ) -> RendezvousClient:
        address = (rendezvous.host, rendezvous.port)
        failure = f"rank {rank} could not reach the rendezvous within {timeout:g} s"
        return cls(await open_retrying(address, deadline, failure))

    async def exchange(
        self, entry: Register, deadline: float, timeout: float
    ) -> list[tuple[str, int]]:
        """Register ``entry``; the table of every rank's address, in rank order."""
        self._connection.send(encode_frame(entry))
        remaining = max(deadline - asyncio.get_running_loop().time(), 0)
        try:
            body = await asyncio.wait_for(self._connection.next_frame(), remaining)
            roster = msgspec.msgpack.decode(body, type=Roster)
        except TimeoutError:
            raise FormationError(
                f"rank {entry.rank}: not every rank registered at the rendezvous within "
                f"{timeout:g} s"
            ) from None
        except (ConnectionError, msgspec.DecodeError) as exc:
            raise FormationError(
                f"rank {entry.rank}: the rendezvous answered no table ({exc})"
            ) from None
        if roster.error is not None:
            raise FormationError(f"rank {entry.rank}: {roster.error}")
        return [(host, port) for host, port in roster.addresses]

    async def close(self) -> None:
        await self._connection.close()
