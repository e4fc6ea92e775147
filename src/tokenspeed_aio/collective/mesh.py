"""The mesh: one TCP connection per pair of an engine's ranks, and the groups over it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from types import TracebackType

from tokenspeed_aio.collective.collectives import Group
from tokenspeed_aio.collective.connection import FrameConnection
from tokenspeed_aio.collective.errors import MeshError
from tokenspeed_aio.collective.formation import Listener, close_all, dial
from tokenspeed_aio.collective.framing import Register
from tokenspeed_aio.collective.link import PeerLink
from tokenspeed_aio.collective.rendezvous import Rendezvous, RendezvousClient, RendezvousServer

DEFAULT_JOB_ID = "tokenspeed"


class Mesh:
    """The async TCP mesh between an engine's rank processes.

    Every rank forms it with ``await Mesh.connect(...)``: from an explicit address table (rank
    ``r`` listens on ``peers[r]``; see ``base_port_addresses``) or from a ``Rendezvous`` that
    rank 0 serves, for ranks on several hosts. Collectives run over groups of ranks
    (``mesh.group(ranks)``, ``mesh.world``). Each peer connection's callbacks demultiplex its
    frames into the groups' inboxes, with no reader task; ``close()`` (or leaving
    ``async with``) closes the connections.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        job_id: str,
        connections: dict[int, FrameConnection],
        collective_timeout: float,
    ):
        self.rank = rank
        self.world_size = world_size
        self.job_id = job_id
        self.collective_timeout = collective_timeout
        self._groups: dict[tuple[int, ...], Group] = {}
        self._closed = False
        groups = self._groups
        self._a_peer_lost = lost = asyncio.Event()

        # Closes over the group table, not the mesh, which the connections need not keep alive.
        # A lost peer wakes the calls waiting in its groups, whichever peer they wait on.
        def on_lost(peer: int) -> None:
            lost.set()
            for group in groups.values():
                if peer in group.ranks:
                    group.wake()

        self._links = {peer: PeerLink(peer, c, on_lost) for peer, c in connections.items()}

    @classmethod
    async def connect(
        cls,
        rank: int,
        world_size: int,
        peers: Sequence[tuple[str, int]] | Rendezvous,
        *,
        job_id: str = DEFAULT_JOB_ID,
        timeout: float = 60.0,
        collective_timeout: float = 60.0,
    ) -> Mesh:
        """Form the mesh; every rank of the job calls this, in any order.

        ``peers`` is the address table (rank ``r`` listens on ``peers[r]``) or a rendezvous.
        ``job_id`` keeps ranks of different jobs from pairing up. ``timeout`` bounds formation
        (raises ``FormationError``); ``collective_timeout`` is the groups' default wait on a
        peer (``math.inf``: no limit) before ``PeerLostError``.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
        table = None if isinstance(peers, Rendezvous) else [(host, port) for host, port in peers]
        if table is not None and len(table) != world_size:
            raise ValueError(f"{len(table)} addresses for a world of {world_size} ranks")
        if world_size == 1:
            # Nothing to connect: a single rank opens no socket; its groups are groups of one.
            return cls(rank, world_size, job_id, {}, collective_timeout)
        deadline = asyncio.get_running_loop().time() + timeout
        if table is None:
            assert isinstance(peers, Rendezvous)
            connections = await _form_via_rendezvous(
                rank, world_size, job_id, peers, deadline, timeout
            )
        else:
            listener = await Listener.start(rank, world_size, job_id, *table[rank])
            connections = await _form(rank, world_size, job_id, table, listener, deadline, timeout)
        return cls(rank, world_size, job_id, connections, collective_timeout)

    def group(self, ranks: Iterable[int]) -> Group:
        """The group of ``ranks`` (this rank among them), for the collectives over them.

        The same set of ranks is the same group, with one call sequence, however it is named.
        """
        key = tuple(sorted(set(ranks)))
        group = self._groups.get(key)
        if group is not None:
            return group
        if self._closed:
            raise MeshError("the mesh is closed")
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} is not in the group {list(key)}")
        outside = [rank for rank in key if not 0 <= rank < self.world_size]
        if outside:
            raise ValueError(f"ranks {outside} are outside the world of {self.world_size} ranks")
        group = self._groups[key] = Group(self.rank, key, self._links, self.collective_timeout)
        return group

    @property
    def world(self) -> Group:
        """The group of every rank."""
        return self.group(range(self.world_size))

    async def peer_lost(self) -> str:
        """Return, saying which and why, once a peer's connection has ended.

        A collective sees a lost peer at once; this is for a rank between collectives (startup,
        where a torch.distributed rendezvous waits minutes for a peer that already failed).
        """
        while True:
            gone = [f"rank {peer} {link.lost}" for peer, link in self._links.items() if link.lost]
            if gone:
                return "; ".join(gone)
            await self._a_peer_lost.wait()

    async def close(self) -> None:
        """Close every connection; calls still waiting raise ``MeshError``. Idempotent.

        Peers see this rank's connections close: a peer waiting on it raises ``PeerLostError``.
        """
        if self._closed:
            return
        self._closed = True
        for group in self._groups.values():
            group.close()
        for link in self._links.values():
            await link.close()

    async def __aenter__(self) -> Mesh:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def _form(
    rank: int,
    world_size: int,
    job_id: str,
    table: list[tuple[str, int]],
    listener: Listener,
    deadline: float,
    timeout: float,
) -> dict[int, FrameConnection]:
    """Dial the lower ranks, then take the higher ranks' connections from ``listener``.

    Dialing one at a time cannot deadlock: every rank listens before it dials, and accepting
    runs in the listener's connection callbacks, not here.
    """
    connections: dict[int, FrameConnection] = {}
    try:
        for peer in range(rank):
            connections[peer] = await dial(
                rank, world_size, job_id, peer, table[peer], deadline, timeout
            )
        connections.update(await listener.accepted(deadline, timeout))
    except BaseException:
        await close_all(list(connections.values()))
        raise
    finally:
        await listener.close()
    return connections


async def _form_via_rendezvous(
    rank: int,
    world_size: int,
    job_id: str,
    rendezvous: Rendezvous,
    deadline: float,
    timeout: float,
) -> dict[int, FrameConnection]:
    """Register this rank's listener at the rendezvous (rank 0 serves it), then form."""
    server = None
    if rank == 0:
        server = await RendezvousServer.start(rendezvous.host, rendezvous.port, world_size, job_id)
    client = listener = None
    try:
        client = await RendezvousClient.dial(rendezvous, rank, deadline, timeout)
        host = rendezvous.local_host or client.local_host
        listener = await Listener.start(rank, world_size, job_id, host, 0)
        entry = Register(job_id, world_size, rank, host, listener.port)
        table = await client.exchange(entry, deadline, timeout)
        return await _form(rank, world_size, job_id, table, listener, deadline, timeout)
    finally:
        if client is not None:
            await client.close()
        if listener is not None:
            await listener.close()
        if server is not None:
            await server.close()
