"""Storage (L3) agreement: the open storage operations of the plans this rank dispatched,
its executor's reports of them and, with several ranks in a replica, their agreement.

Every round with L3, each member's executor report (its clock, queue depth, whether its
store is up, completions, and an error when the report broke a rule) rides the round's
relay exchange -- the same all-gather that hands out the frontend's messages, so a round
runs one exchange, not two. At the head every member applies the same gathered reports:
an operation completes once every member reported it, as a success only if it succeeded
on every member (a QUERY finds the smallest leading run any member found); a failure on
any member fails it everywhere. The store counts as up only while every member's is:
while it is down the scheduler plans no preparation and no publication (its requests
recompute at once). A report that names an operation not open, or one already reported,
is an error that reaches every member in the same exchange, so every member stops
together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from tokenspeed_aio.scheduler.cache_ops import CancelOp, StorageOp
from tokenspeed_aio.scheduler.plan import ExecutionPlan
from tokenspeed_aio.wire.messages import Load, TransferRecord

# A report as it travels: (clock, queue depth, store up, [(op id, ok, value, error, seconds)]).
WireReport = tuple[float, int, bool, list[tuple[int, bool, int, str | None, float]]]


class StorageOpError(RuntimeError):
    """A storage report broke the exactly-once rule: the rank stops."""


@dataclass(frozen=True, slots=True)
class StorageResult:
    """One storage operation's outcome, on one rank or agreed across the replica."""

    op_id: int
    ok: bool
    value: int = 0  # QUERY: leading objects found; GET and PUT: bytes moved
    error: str | None = None  # why it failed ("timed out", "cancelled", the store's error)
    seconds: float = 0.0  # submission to completion, on the slowest member


@dataclass(frozen=True, slots=True)
class StorageReport:
    """What a rank's L3 executor reports at a poll."""

    clock: float
    queue_depth: int  # operations submitted and not completed yet
    results: list[StorageResult] = field(default_factory=list)
    store_up: bool = True  # False while the executor has the store marked down

    def wire(self) -> WireReport:
        rows = [(r.op_id, r.ok, r.value, r.error, r.seconds) for r in self.results]
        return (self.clock, self.queue_depth, self.store_up, rows)


@dataclass(slots=True)
class StorageStats:
    """Counts since start, by kind (the load report carries them)."""

    ops: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    timeouts: int = 0
    cancelled: int = 0
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    queue_depth: int = 0  # the worst member's, as of the last exchange

    def add(self, kind: str, result: StorageResult) -> None:
        self.ops[kind] = self.ops.get(kind, 0) + 1
        self.seconds[kind] = self.seconds.get(kind, 0.0) + result.seconds
        if result.ok:
            self.bytes[kind] = self.bytes.get(kind, 0) + (result.value if kind != "query" else 0)
            return
        if result.error == "cancelled":
            self.cancelled += 1
            return
        self.failures[kind] = self.failures.get(kind, 0) + 1
        if result.error == "timed out":
            self.timeouts += 1


class StorageOps:
    def __init__(self, members: int = 1) -> None:
        self.members = members  # ranks of the replica, each with its own executor
        self._open: dict[int, str] = {}  # op id -> kind
        # op id -> the results received so far, one per member
        self._reported: dict[int, dict[int, StorageResult]] = {}
        self._mine: set[int] = set()  # op ids this rank's executor reported already
        self._records: list[TransferRecord] = []
        self.store_up = True  # every member's store, as of the last agreement
        self.stats = StorageStats()

    @property
    def open(self) -> int:
        return len(self._open)

    def dispatched(self, plan: ExecutionPlan) -> list[StorageOp]:
        """The plan's storage operations (the ones the executor runs), now open."""
        if plan.cache is None or not plan.cache.storage:
            return []
        for op in plan.cache.storage:
            if not isinstance(op, CancelOp):
                self._open[op.op_id] = op.kind
        return plan.cache.storage

    def check(self, report: StorageReport) -> str | None:
        """This rank's report before it is sent: the first broken rule, if any."""
        for result in report.results:
            if result.op_id in self._mine:
                return f"storage op {result.op_id} was reported twice"
            if result.op_id not in self._open:
                return f"storage op {result.op_id} was reported but is not open"
            self._mine.add(result.op_id)
        return None

    def agree(self, reports: list[WireReport]) -> list[StorageResult]:
        """The operations every member has now reported, agreed; applies the same
        gathered reports on every member."""
        done = []
        depth = 0
        self.store_up = all(report[2] for report in reports)
        for member, (_clock, queue_depth, _up, rows) in enumerate(reports):
            depth = max(depth, queue_depth)
            for op_id, ok, value, error, seconds in rows:
                got = self._reported.setdefault(op_id, {})
                got[member] = StorageResult(op_id, ok, value, error, seconds)
                if len(got) == self.members:
                    done.append(op_id)
        self.stats.queue_depth = depth
        agreed = []
        for op_id in sorted(done):
            results = list(self._reported.pop(op_id).values())
            kind = self._open.pop(op_id)
            self._mine.discard(op_id)
            failed = [r for r in results if not r.ok]
            seconds = max(r.seconds for r in results)
            if failed:
                result = StorageResult(op_id, False, 0, failed[0].error, seconds)
            elif kind == "query":
                result = StorageResult(op_id, True, min(r.value for r in results), None, seconds)
            else:
                result = StorageResult(op_id, True, sum(r.value for r in results), None, seconds)
            self.stats.add(kind, result)
            self._records.append(_record(kind, result))
            agreed.append(result)
        return agreed

    def take_records(self) -> list[TransferRecord]:
        """The operations agreed since the last call, for the metrics' histograms."""
        records, self._records = self._records, []
        return records

    def report(self, load: Load) -> Load:
        """The load report with the agreed storage counts filled in."""
        if load.cache is None:
            return load
        st = self.stats
        cache = msgspec.structs.replace(
            load.cache,
            l3_get_bytes=st.bytes.get("get", 0),
            l3_put_bytes=st.bytes.get("put", 0),
            l3_failures=sum(st.failures.values()),
            l3_timeouts=st.timeouts,
            l3_queue_depth=st.queue_depth,
        )
        return msgspec.structs.replace(load, cache=cache)

    def check_idle(self) -> None:
        if self._open or self._reported:
            raise AssertionError(f"storage ops still open: {sorted(self._open)[:16]}")


def _record(kind: str, result: StorageResult) -> TransferRecord:
    if result.ok:
        outcome = "ok"
    else:
        outcome = {"timed out": "timeout", "cancelled": "cancelled"}.get(result.error, "failed")
    moved = result.value if result.ok and kind != "query" else 0
    return TransferRecord(f"l3_{kind}", outcome, moved, result.seconds)
