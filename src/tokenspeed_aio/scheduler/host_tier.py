"""The scheduler's half of the host KV tiers: the L2 host pool's write policies, L2 hits,
and retraction images in the snapshot pool. It plans the plan's cache ops and applies
their acknowledgments; the scheduler calls it at fixed points of a plan build
(``begin_plan``, admission, retraction, ``end_plan``) and at the head (``acknowledged``).

- write_through: every block the device prefix cache publishes is written to L2 by the
  next plan's stores (the forward computing it was dispatched before them), its device
  source pinned until the ACK, so the copy fences nothing.
- write_back: a device block is written to L2 only when an allocation evicts it: a
  stream-ordered store that reads its old bytes before the new owner writes them.
- L2 hits: admission continues the device prefix lookup into L2; the hit pages are loaded
  into fresh device blocks in the same plan (LoadBackOp), their host sources pinned.
- retraction images: a victim's hash-complete pages go to L2 (a stream-ordered write-back,
  or a reference to the copy L2 already holds), its tail pages and slot state to the
  snapshot pool; once both stores and every L2 page it names have landed, it may be
  restored into a new slot (RestoreOp) and continue without recomputing anything.

Every page an open op names is owned by the op until its ACK; an image owns its pages
until its request was restored or ended.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenspeed_aio.scheduler.block_pool import BlockPool
from tokenspeed_aio.scheduler.cache_ops import (
    WRITE_POLICIES,
    WRITE_THROUGH,
    CacheOp,
    CachePlan,
    LoadBackOp,
    RestoreOp,
    SnapshotOp,
    WriteBackOp,
)
from tokenspeed_aio.scheduler.host_pool import HostBlockPool
from tokenspeed_aio.scheduler.plan import ExecutionPlan
from tokenspeed_aio.scheduler.prefix_cache import hash_full_blocks
from tokenspeed_aio.scheduler.request import Request


@dataclass(frozen=True)
class HostTierConfig:
    num_blocks: int  # L2 host pool blocks
    num_snapshot_pages: int  # snapshot pool pages (retraction victims' tail pages)
    num_snapshot_states: int  # snapshot pool slot-state entries (one per image)
    write_policy: str = WRITE_THROUGH

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}")


@dataclass(slots=True)
class RetractionImage:
    """What a retracted request resumes from, instead of recomputing."""

    num_computed: int  # KV positions it held
    sampled_on_slot: bool  # its slot held its last sampled token (it resumes decoding)
    l2_blocks: list[int]  # host blocks of its hash-complete pages, referenced here
    snapshot_pages: list[int]  # its tail pages
    state: int  # its slot state's entry
    pending: int  # its stores not acknowledged yet
    discarded: bool = False  # its request ended: released once ``pending`` reaches 0

    @property
    def num_pages(self) -> int:
        return len(self.l2_blocks) + len(self.snapshot_pages)


@dataclass
class HostTierStats:
    """Counts since start (the load report carries them)."""

    l2_hit_tokens: int = 0  # prompt tokens admitted from L2 (loaded back, not computed)
    images: int = 0  # retraction victims imaged (the rest recomputed)
    restores: int = 0  # images restored into a slot
    dropped_write_backs: int = 0  # blocks not written to L2: every host block referenced


class HostTier:
    def __init__(
        self, config: HostTierConfig, pool: BlockPool, page_size: int, prefix_caching: bool
    ) -> None:
        self.config = config
        self.pool = pool
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.host = HostBlockPool(config.num_blocks, pool.events)
        self.write_through = config.write_policy == WRITE_THROUGH
        if prefix_caching:  # without hashes there is nothing to publish or look up
            if self.write_through:
                pool.published = []
            else:
                pool.evicted = []
        self._snapshot_pages = list(range(config.num_snapshot_pages - 1, -1, -1))
        self._snapshot_states = list(range(config.num_snapshot_states - 1, -1, -1))
        # op id -> (op, the request it advances, the image it belongs to)
        self._open: dict[int, tuple[CacheOp, Request | None, RetractionImage | None]] = {}
        self._next_op_id = 0
        self.stats = HostTierStats()
        # With the L3 tier: where the blocks whose write-back landed go (to be published)
        self.landed_sink: list[int] | None = None

    # -- planning ------------------------------------------------------------
    def begin_plan(self, plan: ExecutionPlan) -> None:
        """Before any allocation of the plan: write through what the device published
        since the last plan (its blocks are still resident: nothing allocated since)."""
        published = self.pool.published
        if not published:
            return
        self.pool.published = []
        pairs = []
        for block in published:
            key = self.pool.key_of(block)
            if key is None or self.host.find(key) is not None:
                continue  # no longer cached, or L2 holds (or is writing) it already
            if not self.host.num_free:
                self.stats.dropped_write_backs += 1
                continue
            self.pool.touch((block,))  # the source is pinned until the ACK
            host_block = self.host.allocate(1)[0]
            self.host.reserve(host_block, key)
            pairs.append((block, host_block))
        if pairs:
            self._write_back(plan, pairs, stream_ordered=False, reason="write_through")

    def end_plan(self, plan: ExecutionPlan) -> None:
        """After the plan's last allocation (write_back): what it evicted goes to L2, read
        before the new owners write (a stream-ordered store)."""
        evicted = self.pool.evicted
        if not evicted:
            return
        self.pool.evicted = []
        pairs = []
        for block, key in evicted:
            if self.host.find(key) is not None:
                continue
            if not self.host.num_free:
                self.stats.dropped_write_backs += 1
                continue
            host_block = self.host.allocate(1)[0]
            self.host.reserve(host_block, key)
            pairs.append((block, host_block))
        if pairs:
            self._write_back(plan, pairs, stream_ordered=True, reason="evicted")

    def lookup(self, keys) -> list[int]:
        """L2 blocks continuing a device prefix hit (published ones only)."""
        return self.host.lookup(keys)

    def plan_load(
        self, plan: ExecutionPlan, req: Request, host_blocks: list[int], dst: list[int]
    ) -> None:
        """Load an L2 hit into the request's fresh device blocks, in the same plan."""
        self.host.ref(host_blocks)  # pinned until the ACK
        op = LoadBackOp(self._op_id(), req.rid, tuple(host_blocks), tuple(dst))
        self._add(plan, op, None, None)
        self.stats.l2_hit_tokens += len(host_blocks) * self.page_size

    def try_image(self, plan: ExecutionPlan, req: Request) -> bool:
        """Plan a retraction victim's image (its two stores); False when none fits (the
        victim then recomputes). The caller frees its device blocks and slot after."""
        computed = req.num_computed
        if computed == 0 or not self._snapshot_states:
            return False
        page = self.page_size
        total = -(-computed // page)
        complete = min(computed, len(req.token_ids)) // page  # hash-complete pages
        if total - complete > len(self._snapshot_pages):
            return False
        if self.prefix_caching:
            hash_full_blocks(req, page)
        l2: list[int | None] = [None] * complete
        found = []
        for i in range(complete if self.prefix_caching else 0):
            block = self.host.find(req.block_hashes[i])
            if block is not None:
                l2[i] = block
                found.append(block)
        self.host.ref(found)  # before allocating: an allocation could evict them
        missing = [i for i in range(complete) if l2[i] is None]
        if len(missing) > self.host.num_free:
            self.host.unref(found)
            return False
        pairs = []
        for i, host_block in zip(missing, self.host.allocate(len(missing))):
            if self.prefix_caching:
                self.host.reserve(host_block, req.block_hashes[i])
            l2[i] = host_block
            pairs.append((req.block_ids[i], host_block))
        pages = [self._snapshot_pages.pop() for _ in range(total - complete)]
        image = RetractionImage(
            num_computed=computed,
            sampled_on_slot=req.sampled_on_slot,
            l2_blocks=l2,
            snapshot_pages=pages,
            state=self._snapshot_states.pop(),
            pending=1 + bool(pairs),
        )
        if pairs:  # the image owns the new blocks' references; the op owns none
            self._write_back(plan, pairs, stream_ordered=True, reason="retraction", image=image)
        snapshot = SnapshotOp(
            self._op_id(),
            req.rid,
            req.slot,
            tuple(req.block_ids[complete:total]),
            tuple(pages),
            image.state,
        )
        self._add(plan, snapshot, None, image)
        req.image = image
        self.stats.images += 1
        return True

    def restore_ready(self, req: Request) -> bool:
        """Both stores of its image and every L2 page it names have landed."""
        image = req.image
        return not image.pending and all(self.host.is_landed(b) for b in image.l2_blocks)

    def plan_restore(self, plan: ExecutionPlan, req: Request, dst: list[int]) -> None:
        image = req.image
        op = RestoreOp(
            self._op_id(),
            req.rid,
            req.slot,
            tuple(image.l2_blocks),
            tuple(image.snapshot_pages),
            tuple(dst),
            image.state,
        )
        self._add(plan, op, req, image)

    def discard(self, req: Request) -> None:
        """A request with an image ended before its restore was planned."""
        image, req.image = req.image, None
        image.discarded = True
        if not image.pending:
            self._release(image)

    # -- the head ------------------------------------------------------------
    def acknowledged(self, op_ids) -> list[tuple[Request, RetractionImage]]:
        """Apply acknowledged ops; returns the requests whose restore landed (with the
        image they resumed from, now released)."""
        restored = []
        for op_id in op_ids:
            entry = self._open.pop(op_id, None)
            if entry is None:
                continue  # the control plane refuses unknown ACKs before they get here
            op, req, image = entry
            if isinstance(op, WriteBackOp):
                self.host.landed(op.dst_blocks)
                if self.landed_sink is not None:
                    self.landed_sink.extend(op.dst_blocks)
                if image is None:  # write-through or eviction: the op held the blocks
                    self.host.unref(op.dst_blocks)
                    if not op.stream_ordered:
                        self.pool.free(op.src_blocks)  # unpin the sources
                else:
                    self._store_landed(image)
            elif isinstance(op, SnapshotOp):
                self._store_landed(image)
            elif isinstance(op, LoadBackOp):
                self.host.unref(op.src_blocks)
            else:
                self._release(image)
                self.stats.restores += 1
                restored.append((req, image))
        return restored

    # -- state -----------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._open or self.pool.published)

    def idle(self) -> bool:
        """No op open, no write-back due, no image held: every host block unreferenced."""
        return not self.has_work() and self.host.num_active == 0

    @property
    def num_open(self) -> int:
        return len(self._open)

    def check_idle(self) -> None:
        if self._open:
            raise AssertionError(f"open cache ops: {sorted(self._open)[:16]}")
        if self.pool.published:
            raise AssertionError(f"write-throughs not planned: {self.pool.published[:16]}")
        cfg = self.config
        if len(self._snapshot_pages) != cfg.num_snapshot_pages:
            raise AssertionError(
                f"snapshot page leak: {len(self._snapshot_pages)}/{cfg.num_snapshot_pages} free"
            )
        if len(self._snapshot_states) != cfg.num_snapshot_states:
            raise AssertionError(
                f"snapshot state leak: {len(self._snapshot_states)}/{cfg.num_snapshot_states} free"
            )
        self.host.check_idle()

    # -- helpers -------------------------------------------------------------------
    def _op_id(self) -> int:
        self._next_op_id += 1
        return self._next_op_id

    def _add(
        self,
        plan: ExecutionPlan,
        op: CacheOp,
        req: Request | None,
        image: RetractionImage | None,
    ) -> None:
        if plan.cache is None:
            plan.cache = CachePlan()
        cache = plan.cache
        if isinstance(op, WriteBackOp):
            cache.write_backs.append(op)
        elif isinstance(op, SnapshotOp):
            cache.snapshots.append(op)
        elif isinstance(op, LoadBackOp):
            cache.loads.append(op)
        else:
            cache.restores.append(op)
        self._open[op.op_id] = (op, req, image)

    def _write_back(
        self,
        plan: ExecutionPlan,
        pairs: list[tuple[int, int]],
        *,
        stream_ordered: bool,
        reason: str,
        image: RetractionImage | None = None,
    ) -> None:
        src, dst = zip(*pairs)
        self._add(plan, WriteBackOp(self._op_id(), src, dst, stream_ordered, reason), None, image)

    def _store_landed(self, image: RetractionImage) -> None:
        image.pending -= 1
        if image.discarded and not image.pending:
            self._release(image)

    def _release(self, image: RetractionImage) -> None:
        self.host.unref(image.l2_blocks)
        self._snapshot_pages.extend(image.snapshot_pages)
        self._snapshot_states.append(image.state)
        image.l2_blocks = []
        image.snapshot_pages = []
