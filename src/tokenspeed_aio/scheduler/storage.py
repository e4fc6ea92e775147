"""The scheduler's half of the L3 storage tier: each waiting request's storage transaction
and the publication of L2 pages to the store. It plans QUERY, GET, PUT and CANCEL
operations into ``plan.cache.storage``, which the control plane submits to the L3
executor; the replica-agreed results come back at the head (``results``).

A waiting request whose prompt continues past its device and L2 prefix hits is first
*prepared*: a QUERY asks which of its next blocks the store holds, a GET fetches the
leading run found into L2 host blocks reserved for them, and only then is it admitted --
with L2 hits, loaded back like any other. While it prepares it is out of the waiting
queue (``Status.PREPARING``), so later rounds neither hash it nor plan it; a failure, a
timeout or a miss settles it the same way with nothing fetched, and it recomputes. While
the store is down (on any rank of the replica, as agreed at the head) nothing is prepared
or published: a request is settled unprepared and recomputes at once, landed pages are
dropped. An abort while preparing finishes it at the next head; its open op is cancelled
and keeps its host blocks until it completes.

Every host block an open GET or PUT names belongs to the op until its result; a GET's
blocks then belong to its request until it is admitted (its admission's L2 lookup takes
its own references) or ends.

PUT: every L2 page that lands with a hash-chain key (a write-back, a retraction image's
page) is published to the store by a later plan, unless the store is known to hold it.
A failed PUT is counted and dropped: the page goes again only if it is written to L2 again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenspeed_aio.scheduler.block_pool import BlockPool
from tokenspeed_aio.scheduler.cache_ops import (
    CachePlan,
    CancelOp,
    GetOp,
    PutOp,
    QueryOp,
    StorageOp,
)
from tokenspeed_aio.scheduler.host_pool import HostBlockPool
from tokenspeed_aio.scheduler.plan import ExecutionPlan
from tokenspeed_aio.scheduler.request import Request, Status

KNOWN_KEYS = 1 << 20  # keys remembered as held by the store (not PUT again)
PUT_BATCH = 16  # pages per PUT


@dataclass(slots=True)
class Preparation:
    """A request's storage transaction."""

    op_id: int = -1  # its open QUERY or GET; -1 once settled
    host_blocks: list[int] = field(default_factory=list)  # fetched, held until admission


@dataclass
class StorageTierStats:
    """Counts since start (the load report carries them)."""

    queries: int = 0  # requests prepared
    query_hit_tokens: int = 0  # prompt tokens the store was found holding
    fetched_tokens: int = 0  # prompt tokens fetched into L2
    recomputed_tokens: int = 0  # found, not in L2, not fetched: the GET failed or L2 was full
    ended_preparing: int = 0  # requests that ended (aborted) while preparing
    unprepared: int = 0  # requests that would have queried, admitted while the store was down
    dropped_puts: int = 0  # landed pages not published: a frozen round, or the store down


class StorageTier:
    def __init__(self, pool: BlockPool, host: HostBlockPool, page_size: int) -> None:
        self.pool = pool
        self.host = host
        self.page_size = page_size
        self.preparing: dict[str, Request] = {}
        # op id -> (op, its request, or None for a PUT)
        self._open: dict[int, tuple[StorageOp, Request | None]] = {}
        self._due: list[StorageOp] = []  # planned at the head, sent with the next plan
        self.landed: list[int] = []  # L2 blocks whose write-back landed (host_tier appends)
        self._known: OrderedDict[int, None] = OrderedDict()  # hashes the store holds
        self._next_op_id = 0
        self.store_up = True  # on every rank, as agreed at the head
        self.stats = StorageTierStats()

    # -- planning ------------------------------------------------------------------
    def prepare(self, plan: ExecutionPlan, req: Request) -> bool:
        """At admission, for a waiting request never prepared (its blocks hashed): plan
        its QUERY when its prompt continues past its device and L2 hits. True: it is now
        preparing (the caller took it off the waiting queue); never while the store is
        down."""
        req.storage_settled = True
        keys = req.block_hashes[: (req.num_tokens - 1) // self.page_size]
        local = len(self.pool.lookup(keys))
        local += len(self.host.lookup(keys[local:]))
        if local == len(keys):
            return False
        if not self.store_up:  # it recomputes what the store might hold
            self.stats.unprepared += 1
            return False
        op = QueryOp(self._op_id(), req.rid, tuple(keys[local:]))
        self._plan(plan, op, req)
        req.storage = Preparation(op.op_id)
        req.status = Status.PREPARING
        self.preparing[req.rid] = req
        self.stats.queries += 1
        return True

    def begin_plan(self, plan: ExecutionPlan, allow_puts: bool) -> None:
        """What the head planned (GETs, CANCELs: sent in every round, frozen ones too, so a
        drain completes them) and the PUTs of pages that landed in L2 -- which a frozen
        round drops (counted): nothing is published while the engine stands still, nor
        while the store is down."""
        if self._due:
            self._cache(plan).storage.extend(self._due)
            self._due = []
        if not self.landed:
            return
        landed = list(self.landed)
        self.landed.clear()  # the host tier holds this list
        if allow_puts and self.store_up:
            self._plan_puts(plan, landed)
        else:
            self.stats.dropped_puts += len(landed)

    def _plan_puts(self, plan: ExecutionPlan, landed: list[int]) -> None:
        keys, blocks = [], []
        for block in landed:
            key = self.host.published_key(block)
            if key is None or key[0] in self._known:
                continue
            self.host.ref((block,))
            self._remember(key[0])
            keys.append(key)
            blocks.append(block)
        for at in range(0, len(keys), PUT_BATCH):
            batch = slice(at, at + PUT_BATCH)
            self._plan(plan, PutOp(self._op_id(), tuple(keys[batch]), tuple(blocks[batch])), None)

    # -- the head ----------------------------------------------------------------------
    def results(self, agreed) -> list[Request]:
        """Apply the replica-agreed results; returns the requests whose preparation
        settled, in order (they return to the front of the waiting queue)."""
        settled = []
        for result in agreed:
            op, req = self._open.pop(result.op_id)
            if isinstance(op, PutOp):
                self.host.unref(op.host_blocks)
                if not result.ok:
                    for key in op.keys:
                        self._known.pop(key[0], None)
                continue
            if isinstance(op, GetOp):
                self._got(op, req, result.ok)
            elif req.status is Status.PREPARING and self._fetch(op, req, result):
                continue  # its GET is planned: still preparing
            if req.status is Status.PREPARING:
                del self.preparing[req.rid]
                req.storage.op_id = -1
                req.status = Status.WAITING
                settled.append(req)
        return settled

    def _fetch(self, op: QueryOp, req: Request, result) -> bool:
        """A QUERY found ``result.value`` leading objects: plan their GET into L2 blocks
        reserved for them (as many as L2 can hold now). False: nothing to fetch."""
        found = result.value if result.ok else 0
        self.stats.query_hit_tokens += found * self.page_size
        for key in op.keys[:found]:
            self._remember(key[0])
        if result.ok and found < len(op.keys):  # gone from the store (evicted, or a new
            self._known.pop(op.keys[found][0], None)  # master): publish it again
        wanted = []
        for key in op.keys[:found]:
            if self.host.find(key) is not None:
                break  # in L2 by now (another request's): admission takes it from there
            wanted.append(key)
        keys = wanted[: self.host.num_free]
        self.stats.recomputed_tokens += (len(wanted) - len(keys)) * self.page_size
        if not keys:
            return False
        blocks = self.host.allocate(len(keys))
        for block, key in zip(blocks, keys):
            self.host.reserve(block, key)
        get = GetOp(self._op_id(), req.rid, tuple(keys), tuple(blocks))
        self._open[get.op_id] = (get, req)
        self._due.append(get)
        req.storage.op_id = get.op_id
        return True

    def _got(self, op: GetOp, req: Request, ok: bool) -> None:
        tokens = len(op.keys) * self.page_size
        if not ok:
            self.host.unref(op.host_blocks)  # reserved, never landed: empty again
            self.stats.recomputed_tokens += tokens
            return
        self.host.landed(op.host_blocks)  # published in L2 (CPU BlockStored events)
        for key in op.keys:
            self._remember(key[0])
        self.stats.fetched_tokens += tokens
        if req.status is Status.PREPARING:
            req.storage.host_blocks = list(op.host_blocks)
        else:  # it ended while fetching: the pages stay in L2, unreferenced
            self.host.unref(op.host_blocks)

    def admitted(self, req: Request) -> None:
        """Its admission looked up (and referenced) its L2 hits: drop the fetch's refs."""
        if req.storage is not None:
            self.host.unref(req.storage.host_blocks)
            req.storage = None

    def ended(self, req: Request) -> None:
        """A preparing or prepared request ended before admission."""
        prep, req.storage = req.storage, None
        if req.status is Status.PREPARING:
            del self.preparing[req.rid]
            self.stats.ended_preparing += 1
            if prep.op_id in self._open:  # its op keeps its blocks until it completes
                self._due.append(CancelOp(prep.op_id))
        self.host.unref(prep.host_blocks)

    def forget(self) -> None:
        """A flush deleted this deployment's objects: nothing is known to be stored."""
        self._known.clear()

    # -- state ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._open or self._due or self.landed)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def check_idle(self) -> None:
        if self._open or self._due or self.preparing or self.landed:
            raise AssertionError(
                f"storage still holds ops={sorted(self._open)[:16]} due={self._due[:8]} "
                f"preparing={list(self.preparing)[:8]}"
            )

    # -- helpers ---------------------------------------------------------------------------
    def _op_id(self) -> int:
        self._next_op_id += 1
        return self._next_op_id

    def _plan(self, plan: ExecutionPlan, op: StorageOp, req: Request | None) -> None:
        self._cache(plan).storage.append(op)
        self._open[op.op_id] = (op, req)

    @staticmethod
    def _cache(plan: ExecutionPlan) -> CachePlan:
        if plan.cache is None:
            plan.cache = CachePlan()
        return plan.cache

    def _remember(self, chain_hash: int) -> None:
        known = self._known
        known[chain_hash] = None
        known.move_to_end(chain_hash)
        if len(known) > KNOWN_KEYS:
            known.popitem(last=False)
