"""Cache-op acknowledgments (the cache_ops subsystem): the open cache ops of the plans this
rank dispatched, the data plane's acknowledgments of them and, with several ranks in a
replica, their intersection across it.

The scheduler is mirrored on every rank of the replica, so an acknowledgment (ACK) may
only advance it once every rank holds it: a rank-local ACK would publish a host block on
one mirrored scheduler while a peer still copies it. The ranks count the same plans, so
the open ops are the same everywhere: every rank polls, and joins the gather, in exactly
the rounds where an op is open -- an idle replica polls nothing -- and stays in every
gather even when it holds nothing new.

The data plane acknowledges each op exactly once, and the counts rely on it: a repeated
ACK, one for an op that is not open, or a landed count that disagrees with the ACKs
received (an ACK lost on the way) is a ``CacheOpError``, never absorbed; so is an op not
acknowledged within ``timeout``. With peers the error rides the gather, so every rank of
the replica stops together (a CollectiveError naming it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from tokenspeed_aio.control.relay import ReplicaGroup
from tokenspeed_aio.scheduler.plan import ExecutionPlan
from tokenspeed_aio.wire.messages import Load

ACK_TIMEOUT_SECONDS = 60.0  # an op open longer than this is lost: the rank stops


class CacheOpError(RuntimeError):
    """An acknowledgment broke the exactly-once rule, or never came: the open-op counts can
    no longer be trusted, so the rank stops."""


@dataclass(frozen=True, slots=True)
class CacheResults:
    """The data plane's completion query (``poll_cache_results``)."""

    acks: list[int]  # op ids whose copies landed since the last poll, each once
    landed: int  # ops landed since start, counted apart from the ids


@dataclass(slots=True)
class _KindStats:
    ops: int = 0
    blocks: int = 0
    seconds: float = 0.0  # dispatch to the replica-agreed ACK, summed


@dataclass
class CacheOpStats:
    by_kind: dict[str, _KindStats] = field(default_factory=dict)

    def add(self, kind: str, blocks: int, seconds: float) -> None:
        stats = self.by_kind.setdefault(kind, _KindStats())
        stats.ops += 1
        stats.blocks += blocks
        stats.seconds += seconds

    def get(self, kind: str) -> _KindStats:
        return self.by_kind.get(kind) or _KindStats()


class CacheOps:
    def __init__(
        self,
        group: ReplicaGroup | None = None,
        *,
        block_bytes: int = 0,
        timeout: float = ACK_TIMEOUT_SECONDS,
    ) -> None:
        self.group = group
        self.block_bytes = block_bytes  # one KV block, all layers (the bytes a copy moves)
        self.timeout = timeout
        self._open: dict[int, tuple[str, int, float]] = {}  # op id -> (kind, blocks, sent at)
        self._held: set[int] = set()  # this rank's ACKs the replica has not agreed on yet
        self._received = 0  # ACK ids received from the data plane since start
        self._max_op_id = 0
        self.stats = CacheOpStats()

    @property
    def open(self) -> int:
        return len(self._open)

    def dispatched(self, plan: ExecutionPlan) -> None:
        """Count the plan's cache ops: the same plan the data plane submits."""
        if plan.cache is None:
            return
        now = time.monotonic()
        for op in plan.cache.ops():
            self._open[op.op_id] = (op.kind, op.num_blocks, now)
            self._max_op_id = max(self._max_op_id, op.op_id)

    async def acknowledged(self, poll: Callable[[], CacheResults]) -> list[int]:
        """The op ids every rank of the replica holds an ACK for, now closed; polls and
        gathers only while an op is open."""
        if not self._open:
            return []
        problem = self._take(poll())
        if self.group is None:
            if problem:
                raise CacheOpError(problem)
            agreed = self._held
        else:
            error = f"CacheOpError: {problem}" if problem else None
            shares = await self.group.all_gather(sorted(self._held), error=error)
            agreed = set(shares[0]).intersection(*shares[1:])
        done = sorted(agreed)
        self._held = self._held - agreed
        now = time.monotonic()
        for op_id in done:
            kind, blocks, sent = self._open.pop(op_id)
            self.stats.add(kind, blocks, now - sent)
        return done

    def _take(self, results: CacheResults) -> str | None:
        """Hold the polled ACKs; the first broken rule, if any."""
        for op_id in results.acks:
            if op_id in self._held or (op_id not in self._open and op_id <= self._max_op_id):
                return f"cache op {op_id} was acknowledged twice"
            if op_id not in self._open:
                return f"cache op {op_id} was acknowledged but never dispatched"
            self._held.add(op_id)
        self._received += len(results.acks)
        if results.landed != self._received:
            return (
                f"the data plane landed {results.landed} cache ops but acknowledged "
                f"{self._received}: {results.landed - self._received} acknowledgment(s) lost"
            )
        now = time.monotonic()
        late = [op_id for op_id, (_, _, sent) in self._open.items() if now - sent > self.timeout]
        if late:
            return f"cache ops {late[:8]} not acknowledged within {self.timeout:g} s"
        return None

    def report(self, load: Load) -> Load:
        """The load report with the cache ops' bytes and latencies filled in."""
        if load.cache is None:
            return load
        loads, stores = self.stats.get("load_back"), self.stats.get("write_back")
        cache = msgspec.structs.replace(
            load.cache,
            load_backs=loads.ops,
            load_back_bytes=loads.blocks * self.block_bytes,
            load_back_seconds=loads.seconds,
            write_backs=stores.ops,
            write_back_bytes=stores.blocks * self.block_bytes,
            write_back_seconds=stores.seconds,
        )
        return msgspec.structs.replace(load, cache=cache)

    def check_idle(self) -> None:
        if self._open or self._held:
            raise AssertionError(
                f"cache ops still open: {sorted(self._open)[:16]}, held: {sorted(self._held)[:16]}"
            )
