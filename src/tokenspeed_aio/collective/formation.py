"""Forming the mesh: one connection per pair of ranks, each opened with a handshake.

Rank ``r`` dials every lower rank and accepts every higher one, so each pair shares exactly one
full-duplex connection. The dialer sends ``Hello``; the dialed rank checks the job id, the
world size and that it is the rank the dialer meant, and answers ``Welcome`` (or why not).
A rejection fails formation on both sides with the reason.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from tokenspeed_aio.collective.connection import FrameConnection, open_connection
from tokenspeed_aio.collective.errors import FormationError
from tokenspeed_aio.collective.framing import Hello, Welcome, encode_frame

logger = logging.getLogger(__name__)

# How often a dialer retries a peer that is not listening yet (ranks start in any order).
_DIAL_RETRY_S = 0.02


def base_port_addresses(
    world_size: int, base_port: int, host: str = "127.0.0.1"
) -> list[tuple[str, int]]:
    """The address table for ranks on one host where rank ``r`` listens on ``base_port + r``."""
    return [(host, base_port + rank) for rank in range(world_size)]


class Listener:
    """Accepts the higher ranks' connections while the mesh forms.

    Each accepted connection's first frame must be a ``Hello``; it is answered from the
    connection's callback, so accepting needs no task. Frames that follow (a peer that
    finished forming already sends collectives) are held for the link that takes over.
    """

    def __init__(self, rank: int, world_size: int, job_id: str):
        self.rank = rank
        self.world_size = world_size
        self.job_id = job_id
        self._accepted: dict[int, FrameConnection] = {}
        self._unanswered: set[FrameConnection] = set()
        # Set once every higher rank connected, or on the first failure (then in ``_error``).
        self._done = asyncio.Event()
        self._error: FormationError | None = None
        self._server: asyncio.Server | None = None
        if rank == world_size - 1:
            self._done.set()

    @classmethod
    async def start(cls, rank: int, world_size: int, job_id: str, host: str, port: int) -> Listener:
        listener = cls(rank, world_size, job_id)
        loop = asyncio.get_running_loop()
        try:
            listener._server = await loop.create_server(listener._connection, host, port)
        except OSError as exc:
            raise FormationError(f"rank {rank} cannot listen on {host}:{port}: {exc}") from exc
        return listener

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    def _connection(self) -> FrameConnection:
        connection = FrameConnection()
        self._unanswered.add(connection)
        connection.receive(lambda body: self._hello(connection, body))
        return connection

    def _hello(self, connection: FrameConnection, body: bytes) -> None:
        connection.receive(None)  # hold what follows for the link
        self._unanswered.discard(connection)
        try:
            hello = msgspec.msgpack.decode(body, type=Hello)
        except msgspec.DecodeError:
            # Not a rank (a port probe, a stray client): formation waits on the ranks.
            logger.debug("rank %d: dropped a connection that sent no valid hello", self.rank)
            connection.close_soon()
            return
        reason = self._reject_reason(hello)
        connection.send(encode_frame(Welcome(self.rank, reason)))
        if reason is not None:
            connection.close_soon()
            self._fail(FormationError(f"rank {self.rank} rejected rank {hello.rank}: {reason}"))
            return
        self._accepted[hello.rank] = connection
        if len(self._accepted) == self.world_size - 1 - self.rank:
            self._done.set()

    def _reject_reason(self, hello: Hello) -> str | None:
        if hello.job_id != self.job_id:
            return f"it belongs to job {hello.job_id!r}, rank {self.rank} to job {self.job_id!r}"
        if hello.world_size != self.world_size:
            return (
                f"its world size is {hello.world_size}, rank {self.rank}'s is "
                f"{self.world_size} (the ranks were started with different layouts)"
            )
        if hello.target != self.rank:
            return (
                f"it meant to dial rank {hello.target}, but rank {self.rank} listens here "
                "(the ranks' address tables differ)"
            )
        if not self.rank < hello.rank < self.world_size:
            return f"only ranks {self.rank + 1}..{self.world_size - 1} dial rank {self.rank}"
        if hello.rank in self._accepted:
            return f"rank {hello.rank} is already connected"
        return None

    def _fail(self, error: FormationError) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    async def accepted(self, deadline: float, timeout: float) -> dict[int, FrameConnection]:
        """Every higher rank's connection, once all arrived; the caller owns them from here."""
        remaining = max(deadline - asyncio.get_running_loop().time(), 0)
        try:
            await asyncio.wait_for(self._done.wait(), remaining)
        except TimeoutError:
            expected = range(self.rank + 1, self.world_size)
            missing = [rank for rank in expected if rank not in self._accepted]
            raise FormationError(
                f"rank {self.rank}: ranks {missing} did not connect within {timeout:g} s"
            ) from None
        if self._error is not None:
            raise self._error
        accepted, self._accepted = self._accepted, {}
        return accepted

    async def close(self) -> None:
        """Stop accepting; close the connections not handed over (formation failed)."""
        if self._server is not None:
            self._server.close()
        leftover = [*self._unanswered, *self._accepted.values()]
        self._unanswered.clear()
        self._accepted.clear()
        await close_all(leftover)


async def open_retrying(address: tuple[str, int], deadline: float, failure: str) -> FrameConnection:
    """Connect to ``address``, retrying while nothing listens there yet, until ``deadline``."""
    loop = asyncio.get_running_loop()
    host, port = address
    while True:
        try:
            return await asyncio.wait_for(
                open_connection(host, port), max(deadline - loop.time(), 0)
            )
        except OSError as exc:
            if loop.time() + _DIAL_RETRY_S >= deadline:
                raise FormationError(f"{failure} at {host}:{port}: {exc!r}") from None
            await asyncio.sleep(_DIAL_RETRY_S)


async def dial(
    rank: int,
    world_size: int,
    job_id: str,
    peer: int,
    address: tuple[str, int],
    deadline: float,
    timeout: float,
) -> FrameConnection:
    """Connect to ``peer`` (retrying until it listens) and pass its handshake."""
    loop = asyncio.get_running_loop()
    host, port = address
    failure = f"rank {rank} could not reach rank {peer} within {timeout:g} s"
    connection = await open_retrying(address, deadline, failure)
    try:
        connection.send(encode_frame(Hello(job_id, world_size, rank, peer)))
        body = await asyncio.wait_for(connection.next_frame(), max(deadline - loop.time(), 0))
        welcome = msgspec.msgpack.decode(body, type=Welcome)
    except TimeoutError:
        await connection.close()
        raise FormationError(
            f"rank {rank}: rank {peer} at {host}:{port} did not answer the handshake within "
            f"{timeout:g} s"
        ) from None
    except (OSError, msgspec.DecodeError) as exc:
        await connection.close()
        raise FormationError(
            f"rank {rank}: no handshake from rank {peer} at {host}:{port} ({exc})"
        ) from None
    except BaseException:
        await connection.close()
        raise
    if welcome.error is not None or welcome.rank != peer:
        await connection.close()
        why = welcome.error or f"rank {welcome.rank} listens there"
        raise FormationError(f"rank {peer} at {host}:{port} rejected rank {rank}: {why}")
    return connection


async def close_all(connections: list[FrameConnection]) -> None:
    """Close connections that never became links (formation failed after opening them)."""
    for connection in connections:
        await connection.close()
