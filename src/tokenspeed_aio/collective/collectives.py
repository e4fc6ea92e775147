"""A group of mesh ranks and the collectives over it."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from tokenspeed_aio.collective.errors import (
    CollectiveError,
    CollectiveOrderError,
    MeshError,
    PeerLostError,
)
from tokenspeed_aio.collective.framing import ENVELOPE_DECODER, Envelope, encode_frame, frame_body
from tokenspeed_aio.collective.link import Inbox, PeerLink
from tokenspeed_aio.collective.reduce import REDUCE_OPS, ReduceOp, check_reducible, reduce_values

_Peer = tuple[int, PeerLink, Inbox]


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class _Call:
    """What a waiting call reports when it fails: which collective, since when, how long."""

    __slots__ = ("deadline", "limit", "op", "seq", "started")

    def __init__(self, op: str, seq: int, limit: float):
        self.op = op
        self.seq = seq
        self.limit = limit
        self.started = asyncio.get_running_loop().time()
        self.deadline = None if limit == math.inf else self.started + limit

    def elapsed(self) -> float:
        return asyncio.get_running_loop().time() - self.started


class Group:
    """A fixed set of a mesh's ranks and the collectives over them (from ``Mesh.group``).

    Every member must enter the same collectives in the same order, decided from
    rank-identical state. Each call carries the group's sequence number and its signature, so
    a differing order raises ``CollectiveOrderError`` instead of pairing unrelated values.

    Results are rank-identical: a rank's own value makes the same msgpack round trip as its
    peers' (a tuple comes back as a list everywhere) and reductions fold in rank order.

    ``timeout`` bounds how long a call waits on its peers, in seconds: ``None`` takes the
    mesh's default and ``math.inf`` waits for ever (a closed connection is still seen at once).
    A group of one runs the same code and returns without network I/O. A group runs one call
    at a time.
    """

    def __init__(
        self, rank: int, ranks: tuple[int, ...], links: dict[int, PeerLink], timeout: float
    ):
        self.rank = rank
        self.ranks = ranks
        self._index = ranks.index(rank)
        self._peers: tuple[_Peer, ...] = tuple(
            (peer, links[peer], links[peer].inbox(ranks)) for peer in ranks if peer != rank
        )
        self._sources = {peer[0]: (peer,) for peer in self._peers}  # broadcast roots
        self._timeout = timeout
        self._seq = 0
        self._busy = False
        self._closed = False
        self._waiter: asyncio.Future[bool] | None = None
        # Set when a call failed mid-exchange: this rank's sequence no longer matches its peers'.
        self._fault: BaseException | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    async def all_gather(
        self, value: Any, *, error: str | None = None, timeout: float | None = None
    ) -> list[Any]:
        """Every member's ``value``, in rank order.

        A member that passes ``error`` (its rank-local failure) contributes it instead of a
        value, and every member raises the same ``CollectiveError`` from this call: the error
        rides the exchange, at no extra round trip.
        """
        return await self._gather("all_gather", value, error, timeout)

    async def agree(self, local_error: str | None, *, timeout: float | None = None) -> None:
        """Raise the same ``CollectiveError`` on every member if any member has an error."""
        await self._gather("agree", None, local_error, timeout)

    async def all_reduce(
        self,
        value: Any,
        op: ReduceOp,
        *,
        error: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Reduce every member's number (or equal-length list of numbers, elementwise).

        ``op`` is ``"min"``, ``"max"`` or ``"sum"``; a sum of bools counts them. Values that do
        not reduce raise the same ``CollectiveError`` on every member. ``error`` as in
        ``all_gather``.
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
        signature = f"all_reduce({op})"
        values = await self._gather(signature, value, error, timeout)
        problem = check_reducible(values)
        if problem is not None:
            index, why = problem
            raise CollectiveError(signature, self.ranks, [(self.ranks[index], f"gave {why}")])
        return reduce_values(values, op)

    async def broadcast(self, value: Any, root: int, *, timeout: float | None = None) -> Any:
        """``root``'s ``value`` on every member; the other members' ``value`` is ignored."""
        if root not in self.ranks:
            raise ValueError(f"broadcast root {root} is not in the group {list(self.ranks)}")
        signature = f"broadcast(root={root})"
        if root == self.rank:
            frame, _ = await self._exchange(signature, value, None, timeout, True, ())
            assert frame is not None  # the root sent it
        else:
            source = self._sources[root]
            _, (frame,) = await self._exchange(signature, None, None, timeout, False, source)
        if frame.error is not None:
            raise CollectiveError(signature, self.ranks, [(root, frame.error)])
        return frame.value

    async def _gather(self, op: str, value: Any, error: str | None, timeout: float | None):
        own, received = await self._exchange(op, value, error, timeout, True, self._peers)
        assert own is not None  # every member sends in a gather
        received.insert(self._index, own)
        errors = [(rank, f.error) for rank, f in zip(self.ranks, received) if f.error is not None]
        if errors:
            raise CollectiveError(op, self.ranks, errors)
        return [frame.value for frame in received]

    async def _exchange(
        self,
        op: str,
        value: Any,
        error: str | None,
        timeout: float | None,
        send: bool,
        sources: tuple[_Peer, ...],
    ) -> tuple[Envelope | None, list[Envelope]]:
        """Send this rank's contribution to every peer (if ``send``), receive one from each source.

        Returns this rank's contribution as its peers decode it, and the sources' in order.
        """
        if self._closed:
            raise MeshError(f"the mesh is closed; cannot run {op} over ranks {list(self.ranks)}")
        if self._fault is not None:
            raise MeshError(
                f"the group of ranks {list(self.ranks)} is unusable after an earlier failure "
                f"(its ranks may be out of step): {self._fault}"
            ) from self._fault
        if self._busy:
            raise RuntimeError(f"{op}: a collective over ranks {list(self.ranks)} is running")
        self._busy = True
        self._seq += 1
        call = _Call(op, self._seq, self._timeout if timeout is None else timeout)
        try:
            own = self._post(call, value, error) if send else None
            received = [await self._receive(call, sources, i) for i in range(len(sources))]
        except BaseException as exc:
            self._fault = exc
            raise
        finally:
            self._busy = False
        return own, received

    def _post(self, call: _Call, value: Any, error: str | None) -> Envelope:
        envelope = Envelope(
            self.ranks, call.seq, call.op, error, None if error is not None else value
        )
        try:
            frame = encode_frame(envelope)
        except (TypeError, ValueError, OverflowError) as exc:
            # An unencodable value is this rank's error: it goes into the agreement.
            envelope = Envelope(self.ranks, call.seq, call.op, f"cannot encode value: {exc}", None)
            frame = encode_frame(envelope)
        for peer, link, _ in self._peers:
            if link.lost is not None:
                raise self._lost(call, peer, link.lost)
            link.send(frame)
        return ENVELOPE_DECODER.decode(frame_body(frame))

    async def _receive(self, call: _Call, sources: tuple[_Peer, ...], index: int) -> Envelope:
        peer, _, inbox = sources[index]
        frames = inbox.frames
        while not frames:
            self._check_reachable(call, sources[index:])
            if not await self._wait(inbox, call.deadline):
                raise PeerLostError(
                    f"rank {peer} did not answer {call.op} #{call.seq} over ranks "
                    f"{list(self.ranks)} within {call.limit:g} s (rank {self.rank} waiting)",
                    peer=peer,
                    op=call.op,
                    elapsed=call.elapsed(),
                )
        frame = frames.popleft()
        if frame.seq != call.seq or frame.op != call.op:
            raise CollectiveOrderError(
                f"collective order differs over ranks {list(self.ranks)}: rank {self.rank} "
                f"entered {call.op} #{call.seq}, but rank {peer} sent {frame.op} #{frame.seq}"
            )
        return frame

    def _check_reachable(self, call: _Call, remaining: tuple[_Peer, ...]) -> None:
        """Raise if a peer still to be heard from is gone (its last frames already arrived)."""
        if self._closed:
            raise MeshError(f"the mesh was closed while rank {self.rank} waited in {call.op}")
        for peer, link, inbox in remaining:
            if link.lost is not None and not inbox.frames:
                raise self._lost(call, peer, link.lost)

    def _lost(self, call: _Call, peer: int, why: str) -> PeerLostError:
        elapsed = call.elapsed()
        return PeerLostError(
            f"rank {peer} {why}; rank {self.rank} was in {call.op} #{call.seq} over ranks "
            f"{list(self.ranks)} for {elapsed:.3f} s",
            peer=peer,
            op=call.op,
            elapsed=elapsed,
        )

    async def _wait(self, inbox: Inbox, deadline: float | None) -> bool:
        """Wait for a frame or a wake-up (True), or until ``deadline`` (False)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        inbox.waiter = self._waiter = waiter
        timer = None if deadline is None else loop.call_at(deadline, _expire, waiter)
        try:
            return await waiter
        finally:
            inbox.waiter = self._waiter = None
            if timer is not None:
                timer.cancel()

    def wake(self) -> None:
        """Make a waiting call re-check its peers (one was lost, or the mesh closed)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def close(self) -> None:
        """The mesh closed: fail the waiting call and every later one."""
        self._closed = True
        self.wake()
