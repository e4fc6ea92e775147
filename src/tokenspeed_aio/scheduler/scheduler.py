"""The scheduler: admission, chunked prefill, continuous batching, retraction.

Pure Python (no torch). The event loop drives it at fixed points of each round:
``submit`` (admission), ``advance_head`` (aborts), ``next_execution_plan`` (plan),
``advance`` (the tail: committed forwards and finished requests), and
``drain_kv_events`` once after the round's last mutation.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from tokenspeed_aio.scheduler.block_pool import BlockPool, chain_hash
from tokenspeed_aio.scheduler.kv_events import KVEvent
from tokenspeed_aio.scheduler.plan import (
    ExecutionPlan,
    ForwardCommitted,
    NewSlotOwner,
    PlannedAbort,
    RequestFinished,
    ScheduledRow,
)
from tokenspeed_aio.scheduler.request import Request, Status
from tokenspeed_aio.wire.messages import Load


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # including the null block
    page_size: int
    max_num_seqs: int  # running requests, = request-pool slots
    max_num_batched_tokens: int  # per-round token budget (chunked_prefill_size)
    max_model_len: int
    enable_prefix_caching: bool = True


_make_row = ScheduledRow._make


class SubmissionRejected(ValueError):
    """The whole submission batch was refused; nothing of it was inserted."""


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.pool = BlockPool(config.num_blocks, config.page_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every request held, finished ones included
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        # plan id -> the dispatched plan's requests, aligned with its rows
        self._inflight: dict[int, tuple[list[Request], list[ScheduledRow]]] = {}
        self._next_plan_id = 0
        self.num_retractions = 0  # preemptions since start (a metric)

    # -- admission ----------------------------------------------------------
    def holds(self, rid: str) -> bool:
        return rid in self.requests

    def submit(self, batch: list[Request]) -> None:
        """Insert a batch of new requests, or refuse all of them (SubmissionRejected)."""
        seen = set()
        for req in batch:
            problem = self._validate(req, seen)
            if problem:
                raise SubmissionRejected(problem)
            seen.add(req.rid)
        now = time.monotonic()
        for req in batch:
            req.submitted_at = now
            self.requests[req.rid] = req
            self.waiting.append(req)

    def _validate(self, req: Request, seen: set[str]) -> str | None:
        if req.rid in self.requests or req.rid in seen:
            return f"request id {req.rid!r} is already in use"
        if req.prompt_len == 0:
            return "the prompt is empty"
        if req.prompt_len >= self.config.max_model_len:
            return (
                f"the prompt has {req.prompt_len} tokens; the context length is "
                f"{self.config.max_model_len} and at least one token must be generated"
            )
        need = self._blocks_for(req.prompt_len)
        if need > self.pool.num_usable:
            return (
                f"the prompt needs {need} KV blocks but the cache has only {self.pool.num_usable}"
            )
        return None

    # -- head ---------------------------------------------------------------
    def advance_head(self, aborted: Iterable[str]) -> None:
        """Apply what must be known before planning: requests the clients aborted."""
        for rid in aborted:
            req = self.requests.get(rid)
            if req is not None and req.status is not Status.FINISHED:
                self._finish(req)

    # -- plan ---------------------------------------------------------------
    def next_execution_plan(self) -> ExecutionPlan:
        plan = ExecutionPlan(plan_id=self._next_plan_id)
        self._next_plan_id += 1
        budget = self.config.max_num_batched_tokens
        # Rows and, aligned with them, their requests for the commit: decodes first.
        decodes: list[ScheduledRow] = []
        prefills: list[ScheduledRow] = []
        decode_reqs: list[Request] = []
        prefill_reqs: list[Request] = []
        running = self.running
        page = self.page_size
        decode = self._schedule_decode
        prefill = self._schedule_prefill
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
                decodes.append(decode(plan, req, num_tokens))
                decode_reqs.append(req)
            else:
                prefills.append(prefill(plan, req, n, num_tokens, None))
                prefill_reqs.append(req)
            budget -= n
            idx += 1
        if not plan.num_retracted:
            budget = self._admit(plan, prefills, prefill_reqs, budget)
        plan.rows = decodes + prefills
        plan.num_tokens = self.config.max_num_batched_tokens - budget
        if plan.rows:
            self._inflight[plan.plan_id] = (decode_reqs + prefill_reqs, plan.rows)
        return plan

    def _admit(
        self,
        plan: ExecutionPlan,
        rows: list[ScheduledRow],
        row_reqs: list[Request],
        budget: int,
    ) -> int:
        page = self.page_size
        while self.waiting and budget > 0 and self._free_slots:
            req = self.waiting[0]
            if req.num_pending:
                break  # retracted with tokens still in flight: re-admit once they land
            hits: list[int] = []
            if self.pool.enable_prefix_caching and not req.wants_prompt_logprobs:
                self._hash_full_blocks(req)
                # At least the last token is recomputed: its logits sample the next one.
                hits = self.pool.lookup(req.block_hashes[: (req.num_tokens - 1) // page])
            computed = len(hits) * page
            n = min(req.num_tokens - computed, budget)
            need = self._blocks_for(computed + n) - len(hits)
            if need > self.pool.num_free - self.pool.num_evictable_among(hits):
                if self._blocks_for(req.num_tokens) <= self.pool.num_usable:
                    break  # it fits once residents give back their blocks
                # Retracted (with tokens in flight) after its tokens outgrew the whole
                # pool: it can never be re-admitted, and as the head it would block the
                # queue forever.
                self._abort_oversize(req, req.num_tokens, plan)
                continue
            self.waiting.popleft()
            self.pool.touch(hits)
            req.block_ids = hits + self.pool.allocate(need)
            req.num_computed = computed
            req.num_cached_blocks = len(hits)
            if not req.num_output:  # first admission (not a retraction's re-admission)
                req.num_cached_tokens = computed
                req.queue_seconds = time.monotonic() - req.submitted_at
            req.slot = self._free_slots.pop()
            req.status = Status.RUNNING
            self.running.append(req)
            owner = NewSlotOwner(
                params=req.params,
                seed=req.seed,
                prompt_token_ids=req.token_ids[: req.prompt_len],
                output_token_ids=req.token_ids[req.prompt_len :],
            )
            rows.append(self._schedule_prefill(plan, req, n, req.num_tokens, owner))
            row_reqs.append(req)
            budget -= n
        return budget

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
                    self._retract(victim)
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

    # The two row builders below run once per running request per round: each reads the
    # request's fields once, into locals, and builds the row with _make (its fields as one
    # tuple, in field order: the cheapest way to build a NamedTuple).
    def _schedule_decode(self, plan: ExecutionPlan, req: Request, num_tokens: int) -> ScheduledRow:
        """A decode: the slot sampled the request's last token, so the row is that one
        position, whose input the device holds (the host may not yet, at depth >= 1), and
        it samples the next token."""
        start = req.num_computed
        block_ids = req.block_ids
        num_blocks = len(block_ids)
        sent = req.num_blocks_sent
        grammar = req.grammar
        if grammar is not None:
            plan.has_grammar = True
        row = _make_row(
            (
                req.rid,  # rid
                req.slot,  # slot
                start,  # start
                1,  # num_tokens
                None,  # token_ids
                () if num_blocks == sent else tuple(block_ids[sent:]),  # new_block_ids
                sent,  # block_offset
                True,  # sample
                num_tokens - req.prompt_len,  # output_index
                None,  # new_owner
                None,  # prompt_logprob_targets: a decode is past the prompt
                req.num_prompt_logprobs,  # prompt_logprobs
                grammar,  # grammar
            )
        )
        req.num_blocks_sent = num_blocks
        req.num_computed = start + 1
        req.num_inflight += 1
        req.num_pending += 1
        # Dispatched positions now cover every known token, so the known tokens alone say
        # which blocks are full.
        if len(req.token_ids) // self.page_size > req.num_cached_blocks:
            self._publish_full_blocks(req)
        return row

    def _schedule_prefill(
        self,
        plan: ExecutionPlan,
        req: Request,
        n: int,
        num_tokens: int,
        new_owner: NewSlotOwner | None,
    ) -> ScheduledRow:
        """A prefill chunk: n positions from num_computed whose inputs the host knows; it
        samples when it reaches the end of the known tokens (num_tokens)."""
        start = req.num_computed
        end = start + n
        sample = end == num_tokens
        token_ids = req.token_ids
        prompt_len = req.prompt_len
        block_ids = req.block_ids
        num_blocks = len(block_ids)
        sent = req.num_blocks_sent
        targets = None
        if start < prompt_len and req.wants_prompt_logprobs:
            targets = token_ids[start + 1 : min(end + 1, prompt_len)]
        grammar = req.grammar if sample else None
        if grammar is not None:
            plan.has_grammar = True
        row = _make_row(
            (
                req.rid,  # rid
                req.slot,  # slot
                start,  # start
                n,  # num_tokens
                token_ids[start:end],  # token_ids
                () if num_blocks == sent else tuple(block_ids[sent:]),  # new_block_ids
                sent,  # block_offset
                sample,  # sample
                num_tokens - prompt_len,  # output_index
                new_owner,  # new_owner
                targets,  # prompt_logprob_targets
                req.num_prompt_logprobs,  # prompt_logprobs
                grammar,  # grammar
            )
        )
        req.num_blocks_sent = num_blocks
        req.num_computed = end
        req.num_inflight += 1
        if sample:
            req.num_pending += 1
            req.sampled_on_slot = True  # from now on its rows are decodes
        known = len(token_ids)
        if (end if end < known else known) // self.page_size > req.num_cached_blocks:
            self._publish_full_blocks(req)  # a block's tokens are now all dispatched
        return row

    def _retract(self, req: Request) -> None:
        """Give back a resident's blocks and slot; it recomputes from the waiting queue."""
        self.running.remove(req)
        self._publish_full_blocks(req)
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
    def advance(self, events: Iterable[ForwardCommitted | RequestFinished]) -> None:
        """Apply the round's committed forwards and finished requests, in order."""
        for event in events:
            if isinstance(event, ForwardCommitted):
                self._committed(event)
            else:
                req = self.requests.get(event.rid)
                if req is not None and req.status is not Status.FINISHED:
                    self._finish(req)

    def _committed(self, event: ForwardCommitted) -> None:
        reqs, rows = self._inflight.pop(event.plan_id)
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
                        self._publish_full_blocks(req)
                    continue
            if status is finished and req.num_inflight == 0:
                del self.requests[req.rid]

    def _finish(self, req: Request) -> None:
        """End a request in any state. Its blocks and slot are reusable at once (the
        device runs forwards in dispatch order, so a later owner's writes land after
        every forward still reading them); its id stays held until those forwards
        are committed."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._publish_full_blocks(req)
            self.pool.free(req.block_ids)
            self._free_slots.append(req.slot)
            req.block_ids = []
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        if req.num_inflight == 0:
            del self.requests[req.rid]

    # -- prefix cache ---------------------------------------------------------
    def _hash_full_blocks(self, req: Request) -> None:
        page = self.page_size
        hashes = req.block_hashes
        for i in range(len(hashes), len(req.token_ids) // page):
            parent = hashes[-1][0] if hashes else None
            tokens = tuple(req.token_ids[i * page : (i + 1) * page])
            hashes.append((chain_hash(parent, tokens), parent, tokens))

    def _publish_full_blocks(self, req: Request) -> None:
        """Cache the blocks whose tokens are all known and computed (dispatched)."""
        if not self.pool.enable_prefix_caching:
            return
        full = min(req.num_computed, len(req.token_ids)) // self.page_size
        if full <= req.num_cached_blocks:
            return
        self._hash_full_blocks(req)
        for i in range(req.num_cached_blocks, full):
            self.pool.cache(req.block_ids[i], *req.block_hashes[i])
        req.num_cached_blocks = full

    # -- reporting --------------------------------------------------------------
    def drain_kv_events(self) -> list[KVEvent]:
        return self.pool.events.drain()

    def load(self) -> Load:
        return Load(
            running=len(self.running),
            waiting=len(self.waiting),
            resident_blocks=self.pool.num_resident,
            active_blocks=self.pool.num_active,
            total_blocks=self.pool.num_usable,
        )

    def has_work(self) -> bool:
        """Anything to plan: a request to run or a forward to commit."""
        return bool(self.running or self.waiting or self._inflight)

    def check_idle(self) -> None:
        """Leak check: no request, slot, block or in-flight forward is held."""
        if self.requests or self.running or self.waiting or self._inflight:
            raise AssertionError(
                f"scheduler still holds requests={list(self.requests)[:8]} "
                f"running={len(self.running)} waiting={len(self.waiting)} "
                f"inflight={list(self._inflight)}"
            )
        if len(self._free_slots) != self.config.max_num_seqs:
            raise AssertionError(f"slot leak: {len(self._free_slots)} free slots")
        self.pool.check_idle()

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
