"""The plan's cache ops: copies between the device KV pool and the host tiers, and the
storage (L3) operations between the L2 host pool and the store.

The scheduler plans them with the rest of the plan and owns every page they name until
their acknowledgment (ACK), which the control plane polls, intersects across the replica
and hands back through ``Scheduler.advance_head`` (Principle 3). Each op has an ``op_id``
(rank-identical: every rank of a replica plans the same ops) and is acknowledged exactly
once, when all of its copies have landed.

The data plane submits them in a fixed order (DeviceHandle.execute): host-bound stores
(write-backs, snapshot stores), the plan's device-to-device copies, page zeroing, then the
device-bound loads (load-backs, restores), then the batch.

Block ids are a tier's own: ``dst_blocks`` of a write-back and ``src_blocks`` of a
load-back index the L2 host pool, snapshot ``pages`` the snapshot pool, the others the
device pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

WRITE_THROUGH = "write_through"
WRITE_BACK = "write_back"
WRITE_POLICIES = (WRITE_THROUGH, WRITE_BACK)


@dataclass(frozen=True, slots=True)
class WriteBackOp:
    """Device blocks -> L2 host blocks, one ACK for the whole batch."""

    kind: ClassVar[str] = "write_back"
    op_id: int
    src_blocks: tuple[int, ...]  # device pool blocks
    dst_blocks: tuple[int, ...]  # L2 host blocks, aligned with src_blocks
    # True: a source may be re-granted and rewritten by this very plan (a retraction image's
    # pages; what this plan's allocations evicted, under write_back), so the copy must read
    # the old bytes before anything else of the plan is enqueued -- it fences the forward
    # stream. False: the scheduler pinned the sources until the ACK (a write-through
    # publication), so the copy overlaps the forward and fences nothing.
    stream_ordered: bool
    reason: str  # "write_through" | "evicted" | "retraction": what planned it (stats, logs)

    @property
    def num_blocks(self) -> int:
        return len(self.src_blocks)


@dataclass(frozen=True, slots=True)
class LoadBackOp:
    """L2 host blocks -> fresh device blocks of a request admitted in the same plan: its
    forward reads them layer by layer behind the load's per-layer fences."""

    kind: ClassVar[str] = "load_back"
    op_id: int
    rid: str  # the admitted request (logs)
    src_blocks: tuple[int, ...]  # L2 host blocks, pinned by the scheduler until the ACK
    dst_blocks: tuple[int, ...]  # device blocks, the request's pages in prefix order

    @property
    def num_blocks(self) -> int:
        return len(self.src_blocks)


@dataclass(frozen=True, slots=True)
class SnapshotOp:
    """A retraction victim's snapshot store: its tail pages (computed, not hash-complete)
    and its slot's state (sampling settings, penalty counts, the future token). The victim's
    hash-complete pages ride a stream-ordered WriteBackOp of the same plan."""

    kind: ClassVar[str] = "snapshot"
    op_id: int
    rid: str
    slot: int  # the victim's request-pool slot, freed by this plan build
    src_blocks: tuple[int, ...]  # device tail pages (may be empty: a page-aligned victim)
    dst_pages: tuple[int, ...]  # snapshot pool pages, aligned with src_blocks
    state: int  # the snapshot pool's slot-state entry

    @property
    def num_blocks(self) -> int:
        return len(self.src_blocks)


@dataclass(frozen=True, slots=True)
class RestoreOp:
    """A retracted request resumes in a new slot: its image (L2 pages, snapshot pages and
    slot state) is copied into fresh device blocks. It overwrites them whole, arms no
    layer fence, and its request is unschedulable until the ACK."""

    kind: ClassVar[str] = "restore"
    op_id: int
    rid: str
    slot: int  # the resumed request's new slot
    l2_blocks: tuple[int, ...]  # L2 host blocks of its hash-complete pages
    snapshot_pages: tuple[int, ...]  # snapshot pool pages of its tail
    dst_blocks: tuple[int, ...]  # device blocks: the L2 pages' first, then the tail's
    state: int  # the snapshot pool's slot-state entry to import

    @property
    def num_blocks(self) -> int:
        return len(self.dst_blocks)


CacheOp = WriteBackOp | LoadBackOp | SnapshotOp | RestoreOp

# -- storage (L3) operations: run by the control plane's L3 executor on host worker
# threads, apart from device work; each completes once every rank of the replica reported
# it (control/storage.py). ``keys`` are hash-chain keys (hash, parent hash, tokens).


@dataclass(frozen=True, slots=True)
class QueryOp:
    """Which of a waiting request's next blocks the store holds: its result is the length
    of the leading run of ``keys`` found (the smallest over the replica's ranks)."""

    kind: ClassVar[str] = "query"
    op_id: int
    rid: str
    keys: tuple[tuple[int, int | None, tuple[int, ...]], ...]


@dataclass(frozen=True, slots=True)
class GetOp:
    """Fetch objects into L2 host blocks reserved for them, before the request is
    admitted; the blocks belong to the op until it completes."""

    kind: ClassVar[str] = "get"
    op_id: int
    rid: str
    keys: tuple[tuple[int, int | None, tuple[int, ...]], ...]
    host_blocks: tuple[int, ...]  # aligned with keys


@dataclass(frozen=True, slots=True)
class PutOp:
    """Publish hash-complete L2 pages (landed, referenced by the op until it completes)."""

    kind: ClassVar[str] = "put"
    op_id: int
    keys: tuple[tuple[int, int | None, tuple[int, ...]], ...]
    host_blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CancelOp:
    """Stop an open QUERY or GET (its request ended): it then completes as cancelled, and
    a GET writes nothing more into its blocks. Completes nothing of its own."""

    kind: ClassVar[str] = "cancel"
    op_id: int  # the op to stop


StorageOp = QueryOp | GetOp | PutOp | CancelOp


@dataclass(slots=True)
class CachePlan:
    """The cache ops of one plan, by kind (each list in planning order)."""

    write_backs: list[WriteBackOp] = field(default_factory=list)
    snapshots: list[SnapshotOp] = field(default_factory=list)
    loads: list[LoadBackOp] = field(default_factory=list)
    restores: list[RestoreOp] = field(default_factory=list)
    # L3 operations: the control plane submits them to the storage executor, not the device
    storage: list[StorageOp] = field(default_factory=list)

    def ops(self) -> list[CacheOp]:
        """The device cache ops (the storage ones are apart)."""
        return [*self.write_backs, *self.snapshots, *self.loads, *self.restores]

    def __bool__(self) -> bool:
        """Any device cache op (a plan with storage ops only needs no device work)."""
        return bool(self.write_backs or self.snapshots or self.loads or self.restores)
