"""The scheduler: admission, chunked prefill, continuous batching, retraction.

Pure Python (no torch). The event loop drives it at fixed points of each round:
``submit`` (admission), ``advance_head`` (acknowledged cache ops, aborts),
``next_execution_plan`` (plan), ``advance`` (the tail: committed forwards and finished
requests), and ``drain_kv_events`` once after the round's last mutation.

With the host tier on (``SchedulerConfig.host``, host_tier.py) a plan also carries cache
ops: L2 write-backs and load-backs, and retraction images -- a capacity retraction's
victim is imaged (stored to the host tiers and restored later, without recompute) when its
image fits, and recomputes from the waiting queue when it does not. With the L3 storage
tier on as well (``SchedulerConfig.storage``, storage.py) a plan carries storage
operations too: a waiting request is prepared (its prefix queried and fetched from the
store into L2) before it is admitted, and pages landing in L2 are published to the store.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from tokenspeed_aio.scheduler.admission import AdmissionMixin, SubmissionRejected
from tokenspeed_aio.scheduler.block_pool import BlockPool
from tokenspeed_aio.scheduler.host_tier import HostTier, HostTierConfig, RetractionImage
from tokenspeed_aio.scheduler.plan import (
    ExecutionPlan,
    ForwardCommitted,
    PlannedAbort,
    RequestFinished,
    ScheduledRow,
    TransferEvent,
    TransferFailed,
    TransferLanded,
)
from tokenspeed_aio.scheduler.prefix_cache import publish_full_blocks
from tokenspeed_aio.scheduler.reporting import ReportingMixin
from tokenspeed_aio.scheduler.request import Request, Status
from tokenspeed_aio.scheduler.rows import schedule_row
from tokenspeed_aio.scheduler.state import SchedulerConfig
from tokenspeed_aio.scheduler.storage import StorageTier
from tokenspeed_aio.scheduler.transfers import ROLES, TransferMixin

__all__ = ["HostTierConfig", "Scheduler", "SchedulerConfig", "SubmissionRejected"]


class Scheduler(AdmissionMixin, TransferMixin, ReportingMixin):
    def __init__(self, config: SchedulerConfig) -> None:
        if config.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {config.role!r}")
        self.config = config
        self.role = config.role
        self.page_size = config.page_size
        self.pool = BlockPool(config.num_blocks, config.page_size, config.enable_prefix_caching)
        self.host_tier = (
            HostTier(config.host, self.pool, config.page_size, config.enable_prefix_caching)
            if config.host is not None
            else None
        )
        self.storage = None
        if config.storage:
            self.storage = StorageTier(self.pool, self.host_tier.host, config.page_size)
            self.host_tier.landed_sink = self.storage.landed
        self.requests: dict[str, Request] = {}  # every request held, finished ones included
        self.waiting: deque[Request] = deque()  # in fair turns (admission.py)
        self._next_round: dict[str, int] = {}
        self._arrivals = 0
        self.running: list[Request] = []  # admission order
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        # plan id -> the dispatched plan's requests, aligned with its rows
        self._inflight: dict[int, tuple[list[Request], list[ScheduledRow]]] = {}
        self._next_plan_id = 0
        self.num_retractions = 0  # preemptions since start (a metric)
        self._init_transfers()
        self.forward_rounds = 0  # plans with a batch, and their tokens (metrics)
        self.forward_tokens = 0

    def holds(self, rid: str) -> bool:
        return rid in self.requests

    # -- head ---------------------------------------------------------------
    def advance_head(
        self,
        aborted: Iterable[str],
        acknowledged: Iterable[int] = (),
        stored: Iterable = (),
        store_up: bool = True,
    ) -> None:
        """Apply what must be known before planning: the cache ops every rank of the
        replica acknowledged (a landed restore makes its request schedulable), the storage
        operations it agreed on (a settled preparation returns its request to the front of
        the waiting queue) and whether the store is up on every rank, then the requests the
        clients aborted (one whose transfer is tracked only parks until the transfer
        retired)."""
        if self.host_tier is not None:
            for req, image in self.host_tier.acknowledged(acknowledged):
                self._restored(req, image)
        if self.storage is not None:
            self.storage.store_up = store_up
            self.waiting.extendleft(reversed(self.storage.results(stored)))
        held = (self.requests.get(rid) for rid in dict.fromkeys(aborted))
        ended = [req for req in held if req is not None and req.status is not Status.FINISHED]
        # Waiting requests leave the queue in one pass: removing each alone is quadratic
        # when a client's thousands of sequences are aborted at once.
        unqueued = {id(r) for r in ended if r.status is Status.WAITING and r.room is None}
        if unqueued:
            kept = [r for r in self.waiting if id(r) not in unqueued]
            self.waiting.clear()
            self.waiting.extend(kept)
        for req in ended:
            if id(req) in unqueued:
                self._finish(req, queued=False)
            else:
                self._end(req)

    def _restored(self, req: Request, image: RetractionImage) -> None:
        req.image = None
        if req.status is Status.FINISHED:  # ended while its restore was in flight
            self.pool.free(req.block_ids)
            self._free_slots.append(req.slot)
            req.block_ids = []
            if req.num_inflight == 0:
                del self.requests[req.rid]
            return
        req.status = Status.RUNNING
        req.num_computed = image.num_computed
        req.sampled_on_slot = image.sampled_on_slot
        req.num_blocks_sent = 0
        req.num_cached_blocks = 0
        self.running.append(req)
        publish_full_blocks(self.pool, req)

    # -- plan ---------------------------------------------------------------
    def next_execution_plan(self, allow_forward: bool = True) -> ExecutionPlan:
        """The round's plan. ``allow_forward=False`` (a frozen round: a keep pause, memory
        released) plans no forward: only cache work -- the write-backs already due; no rows,
        no admission, no retraction."""
        plan = ExecutionPlan(plan_id=self._next_plan_id)
        self._next_plan_id += 1
        tier = self.host_tier
        if tier is not None:
            tier.begin_plan(plan)
        if self.storage is not None:
            self.storage.begin_plan(plan, allow_puts=allow_forward)
        if not allow_forward:
            return plan
        budget = self.config.max_num_batched_tokens
        # Rows and, aligned with them, their requests for the commit: decodes first.
        decodes: list[ScheduledRow] = []
        prefills: list[ScheduledRow] = []
        decode_reqs: list[Request] = []
        prefill_reqs: list[Request] = []
        running = self.running
        page = self.page_size
        pool = self.pool
        idx = 0
        # This loop runs for every running request every round: its arithmetic is
        # inlined (num_tokens, num_output, "needs a block") rather than called.
        while idx < len(running) and budget > 0:
            req = running[idx]
            num_tokens = len(req.token_ids) + req.num_pending
            computed = req.num_computed
            n = num_tokens - computed
            if n > budget:
                n = budget
            if n <= 0 or (
                computed + n == num_tokens and num_tokens - req.prompt_len >= req.max_output
            ):
                idx += 1  # everything it needs is dispatched; its commit will finish it
                continue
            if computed + n > len(req.block_ids) * page and not self._reserve(req, n, plan):
                continue  # req itself was retracted or aborted and left self.running
            if req.sampled_on_slot:  # a decode: n == 1, the position its slot sampled
                decodes.append(schedule_row(plan, req, 1, num_tokens, None, pool))
                decode_reqs.append(req)
            else:
                prefills.append(schedule_row(plan, req, n, num_tokens, None, pool))
                prefill_reqs.append(req)
            budget -= n
            idx += 1
        budget = self._schedule_landed(plan, prefills, prefill_reqs, budget)
        if not plan.num_retracted:
            budget = self._admit(plan, prefills, prefill_reqs, budget)
        if self.role == "prefill":
            self._note_handoffs(plan, prefills, prefill_reqs, len(decodes))
        self._plan_transfers(plan)
        if tier is not None:
            tier.end_plan(plan)
        plan.rows = decodes + prefills
        plan.num_tokens = self.config.max_num_batched_tokens - budget
        if plan.num_tokens:  # iteration counts for the load report (metrics)
            self.forward_rounds += 1
            self.forward_tokens += plan.num_tokens
        if plan.rows:
            self._inflight[plan.plan_id] = (decode_reqs + prefill_reqs, plan.rows)
        return plan

    def _reserve(self, req: Request, n: int, plan: ExecutionPlan) -> bool:
        """Find blocks for n more tokens of a running request, retracting the newest
        residents if needed. False when req itself had to leave the running set."""
        need = self._blocks_for(req.num_computed + n) - len(req.block_ids)
        if need > self.pool.num_free:
            usable = self.pool.num_usable
            if self._blocks_for(req.num_computed + n) > usable:
                # Not even alone: retracting the others would not help.
                self._abort_oversize(req, req.num_computed + n, plan)
                return False
            while need > self.pool.num_free:
                victim = self.running[-1]
                if not victim.num_pending and self._blocks_for(victim.num_tokens) > usable:
                    # Its known tokens outgrew the pool: retracted, it could never return.
                    self._abort_oversize(victim, victim.num_tokens, plan)
                else:
                    self._retract(victim, plan)
                    plan.num_retracted += 1
                    self.num_retractions += 1
                if victim is req:
                    return False
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def _abort_oversize(self, req: Request, num_tokens: int, plan: ExecutionPlan) -> None:
        """End a request whose next forward needs num_tokens positions of KV, more than
        the whole pool holds: it cannot run even alone."""
        self._finish(req)
        plan.aborts.append(
            PlannedAbort(
                req.rid,
                f"the request grew to {num_tokens} tokens, more than "
                f"the KV cache holds ({self.pool.num_usable * self.page_size})",
            )
        )

    def _retract(self, req: Request, plan: ExecutionPlan) -> None:
        """Give back a resident's blocks and slot. With the host tier, its image is stored
        first when it fits (the plan's stores read the pages before anything re-grants
        them); otherwise it recomputes from the waiting queue."""
        self.running.remove(req)
        publish_full_blocks(self.pool, req)
        if self.host_tier is not None and req.room is None:  # a PD transfer's pages stay
            self.host_tier.try_image(plan, req)
        self.pool.free(req.block_ids)
        self._free_slots.append(req.slot)
        req.slot = -1
        req.sampled_on_slot = False
        req.block_ids = []
        req.num_blocks_sent = 0
        req.num_cached_blocks = 0
        req.num_computed = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    # -- tail ---------------------------------------------------------------
    def advance(self, events: Iterable[ForwardCommitted | RequestFinished | TransferEvent]) -> None:
        """Apply the round's committed forwards, finished requests and agreed transfer
        progress, in order."""
        for event in events:
            if isinstance(event, ForwardCommitted):
                self._committed(event)
            elif isinstance(event, RequestFinished):
                req = self.requests.get(event.rid)
                if req is not None and req.status is not Status.FINISHED:
                    self._end(req)
            elif isinstance(event, TransferLanded):
                self._land(event.rid, event.token)
            elif isinstance(event, TransferFailed):
                req = self.requests.get(event.rid)
                if req is not None:
                    self._park(req)
            else:
                self._retire(event.rid)

    def _committed(self, event: ForwardCommitted) -> None:
        entry = self._inflight.pop(event.plan_id, None)
        if entry is None:
            return  # a plan without rows (cache work, remote streams): nothing to commit
        reqs, rows = entry
        tokens = iter(event.tokens)
        # Status members read once: an enum attribute read costs as much as the rest of
        # a request's commit.
        finished = Status.FINISHED
        running = Status.RUNNING
        page = self.page_size
        for req, row in zip(reqs, rows):
            req.num_inflight -= 1
            status = req.status
            if row.sample:
                req.num_pending -= 1
                token = next(tokens)
                if token is not None and status is not finished:
                    token_ids = req.token_ids
                    token_ids.append(token)
                    # Only a token that completes a page can complete a block.
                    if len(token_ids) % page == 0 and status is running:
                        publish_full_blocks(self.pool, req)
                    continue
            if status is finished and req.num_inflight == 0 and req.image is None:
                del self.requests[req.rid]
        if self._handoffs:
            self._hand_off(event)

    def _end(self, req: Request) -> None:
        """An abort or the output's end: a request whose transfer is still tracked parks
        (its pages wait for the transfer to retire), any other finishes."""
        if req.room is not None:
            self._park(req)
        else:
            self._finish(req)

    def _finish(self, req: Request, *, queued: bool = True) -> None:
        """End a request in any state. Its blocks and slot are reusable at once (the
        device runs forwards in dispatch order, so a later owner's writes land after
        every forward still reading them); its id stays held until those forwards
        are committed. ``queued``: False for a waiting request already taken out of
        the queue."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            publish_full_blocks(self.pool, req)
            self.pool.free(req.block_ids)
            self._free_slots.append(req.slot)
            req.block_ids = []
        elif req.status is Status.WAITING:
            if queued:
                self.waiting.remove(req)
            if req.image is not None:
                self.host_tier.discard(req)
            if req.storage is not None:
                self.storage.ended(req)
        elif req.status is Status.PREPARING:  # its open op is cancelled, keeps its pages
            self.storage.ended(req)
        elif req.status is Status.TRANSFERRING:  # its pages and slot, if any
            self._unqueue(req)
            self.pool.free(req.block_ids)
            req.block_ids = []
            if req.slot >= 0:
                self._free_slots.append(req.slot)
                req.slot = -1
        # RESTORING: its blocks and slot stay with the restore until it lands (_restored)
        req.status = Status.FINISHED
        if req.num_inflight == 0 and req.image is None:
            del self.requests[req.rid]

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
