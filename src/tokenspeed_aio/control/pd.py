"""The transfer peer as the loop sees it (prefill/decode disaggregation), and the
replica's per-round agreement on transfer progress.

Requests register with the peer at admission, on every rank in the same round; client
aborts cancel their transfers. Every round with a transfer tracked, each rank polls its
peer for what changed there and the replica all-gathers those changes, so every rank
decides alike:

* **landed** (decode) once every rank's share of the KV and the first token landed;
* **failed** once any rank failed: every rank stops new work for the room (a cancel),
  the request fails toward its client, but keeps its pages;
* **retired** once every rank's jobs retired (sent, or provably stopped): the pages
  are free.

The decisions feed the output module and then the scheduler's tail advance; this
module advances nothing itself. It never touches the device: the peer (pd/) runs the
transfers on its own threads and is reached only through ``TransferPeer``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from tokenspeed_aio.control.relay import ReplicaGroup
from tokenspeed_aio.scheduler.request import Request
from tokenspeed_aio.wire.messages import Bootstrap, TokenLogprobs, TransferRecord

LANDED, FAILED, RETIRED = "landed", "failed", "retired"


class PeerEvent(msgspec.Struct, array_like=True, frozen=True):
    """What one rank's peer reports about one request, once per change."""

    rid: str
    kind: str  # LANDED (decode: KV and first token in), FAILED, RETIRED (jobs done)
    token: int = -1  # LANDED: the bootstrap token
    logprobs: TokenLogprobs | None = None  # LANDED: its logprobs, when asked
    ok: bool = False  # RETIRED: the send completed (a prefill engine's success)
    status: int = 0  # FAILED: an HTTP-like status (400: a bad request, 503: a peer fault)
    message: str = ""  # FAILED: what the client is told
    num_bytes: int = 0  # LANDED / RETIRED: KV bytes this rank moved
    seconds: float = 0.0  # LANDED / RETIRED: how long this rank's transfer took


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[PeerEvent]).decode


class TransferPeer(Protocol):
    """The control face of a rank's transfer peer (pd/peer.py). Thread-safe, never
    blocks: the peer's own threads do the networking and the KV writes."""

    role: str  # "prefill" | "decode"

    def register(self, rid: str, bootstrap: Bootstrap) -> None:
        """A disaggregated request was admitted: track its room."""
        ...

    def cancel(self, rid: str) -> None:
        """Stop the request's transfer (repeating it is safe); its RETIRED follows once
        no remote write can still touch its pages."""
        ...

    def poll(self) -> list[PeerEvent]:
        """What changed on this rank since the last poll."""
        ...

    def gauges(self) -> tuple[int, int]:
        """(rooms waiting unclaimed, landing pages held for a peer that has not yet
        proven its writes stopped)."""
        ...


@dataclass(frozen=True, slots=True)
class Landed:
    rid: str
    token: int
    logprobs: TokenLogprobs | None


@dataclass(frozen=True, slots=True)
class Failed:
    rid: str
    status: int
    message: str


@dataclass(frozen=True, slots=True)
class Retired:
    rid: str
    ok: bool


Outcome = Landed | Failed | Retired


@dataclass(slots=True)
class _Tracked:
    started: float
    landed: dict[int, PeerEvent] = field(default_factory=dict)  # rank index -> its LANDED
    retired: set[int] = field(default_factory=set)
    failure: PeerEvent | None = None
    failure_sent: bool = False
    cancelled: bool = False
    ok: bool = True  # every RETIRED so far reported a completed send
    num_bytes: int = 0
    seconds: float = 0.0


class PdTransfers:
    """Rank-identical bookkeeping of the transfers the replica tracks."""

    def __init__(
        self, peer: TransferPeer | None, group: ReplicaGroup | None = None, size: int = 1
    ) -> None:
        self.peer = peer
        self.role = "plain" if peer is None else peer.role
        self.group = group
        self.size = size
        self.tracked: dict[str, _Tracked] = {}
        self.records: list[TransferRecord] = []  # ended transfers, for the metrics

    @property
    def in_flight(self) -> int:
        return len(self.tracked)

    def register(self, requests: list[Request]) -> list[Request]:
        """Track the admitted requests' transfers (the submitted batch, returned as is)."""
        for req in requests:
            if req.bootstrap is not None and self.peer is not None:
                self.tracked[req.rid] = _Tracked(time.monotonic())
                self.peer.register(req.rid, req.bootstrap)
        return requests

    def cancel(self, rids: list[str]) -> None:
        """Client aborts: cancel the tracked transfers among them."""
        for rid in rids:
            tracked = self.tracked.get(rid)
            if tracked is not None and not tracked.cancelled:
                tracked.cancelled = True
                self.peer.cancel(rid)

    def gauges(self) -> tuple[int, int, int]:
        """(in flight, unclaimed rooms, quarantined pages) for the load report."""
        if self.peer is None:
            return 0, 0, 0
        return (self.in_flight, *self.peer.gauges())

    async def agree(self, error: str | None = None) -> list[Outcome]:
        """This round's agreed transfer progress (a collective while any is tracked)."""
        if not self.tracked:
            return []
        local = self.peer.poll()
        if self.group is None:
            shares = [local]
        else:
            shares = [_decode(s) for s in await self.group.all_gather(_encode(local), error=error)]
        changed: dict[str, _Tracked] = {}
        for rank, events in enumerate(shares):
            for event in events:
                tracked = self.tracked.get(event.rid)
                if tracked is not None:
                    self._apply(tracked, rank, event)
                    changed[event.rid] = tracked
        return [out for rid, t in changed.items() for out in self._decide(rid, t)]

    def _apply(self, t: _Tracked, rank: int, event: PeerEvent) -> None:
        if event.kind == LANDED:
            t.landed[rank] = event
            t.retired.add(rank)
        elif event.kind == FAILED:
            if t.failure is None:
                t.failure = event
        else:
            t.retired.add(rank)
            t.ok = t.ok and event.ok
        t.num_bytes += event.num_bytes
        t.seconds = max(t.seconds, event.seconds)

    def _decide(self, rid: str, t: _Tracked) -> list[Outcome]:
        outcomes: list[Outcome] = []
        if t.failure is not None and not t.failure_sent:
            t.failure_sent = True
            outcomes.append(Failed(rid, t.failure.status, t.failure.message))
            if not t.cancelled:  # every rank stops new work for the room
                t.cancelled = True
                self.peer.cancel(rid)
        if t.failure is None and not t.cancelled and len(t.landed) == self.size:
            first = t.landed[min(t.landed)]
            outcomes.append(Landed(rid, first.token, first.logprobs))
            self._end(rid, t, "ok")
        elif len(t.retired) == self.size:
            ok = t.ok and t.failure is None and not t.cancelled
            outcomes.append(Retired(rid, ok))
            outcome = "ok" if ok else "failed" if t.failure is not None else "cancelled"
            self._end(rid, t, outcome)
        return outcomes

    def _end(self, rid: str, t: _Tracked, outcome: str) -> None:
        del self.tracked[rid]
        seconds = t.seconds or time.monotonic() - t.started
        self.records.append(TransferRecord(self.role, outcome, t.num_bytes, seconds))

    def take_records(self) -> list[TransferRecord]:
        records, self.records = self.records, []
        return records
