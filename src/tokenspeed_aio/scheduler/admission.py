"""The scheduler's admission half: a submission batch is validated whole, then waiting
requests are admitted into the round's plan as budget, free slots and KV blocks allow,
reusing cached prefix blocks -- on the device, then, with the host tier, in L2 (loaded
back in the same plan) -- and a retracted request with an image is restored into a slot
once its stores landed.

``Scheduler`` (scheduler.py) takes these methods; they read and change its state.
"""

from __future__ import annotations

import time

from tokenspeed_aio.scheduler.plan import ExecutionPlan, NewSlotOwner, ScheduledRow
from tokenspeed_aio.scheduler.prefix_cache import hash_full_blocks
from tokenspeed_aio.scheduler.request import Request, Status
from tokenspeed_aio.scheduler.rows import schedule_row
from tokenspeed_aio.scheduler.state import SchedulerState


def _turn(req: Request) -> tuple[int, int]:
    return req.turn


class SubmissionRejected(ValueError):
    """The whole submission batch was refused; nothing of it was inserted."""


class AdmissionMixin(SchedulerState):
    _next_round: dict[str, int]  # group -> the round its next waiting sequence gets
    _arrivals: int

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
        self._enqueue_fairly(batch)

    def _enqueue_fairly(self, batch: list[Request]) -> None:
        """Per-request fair admission: the waiting queue is ordered by turn, (round,
        arrival), where a request's k-th waiting sequence has round k past the queue's
        current round (its head's). One request of 16,000 sequences beside one of a single
        sequence: the small one is admitted right after the big one's current head, not
        behind its 16,000 -- requests take the queue in turns, sequences of one request
        keep their order."""
        head_round = self.waiting[0].turn[0] if self.waiting else 0
        for req in batch:
            rnd = max(self._next_round.get(req.group, 0), head_round)
            self._next_round[req.group] = rnd + 1
            req.turn = (rnd, self._arrivals)
            self._arrivals += 1
        batch = sorted(batch, key=_turn)
        if not self.waiting or self.waiting[-1].turn <= batch[0].turn:
            self.waiting.extend(batch)  # the common case: nothing jumps ahead
        else:
            merged = sorted((*self.waiting, *batch), key=_turn)
            self.waiting.clear()
            self.waiting.extend(merged)
        if len(self._next_round) > 2 * len(self.waiting) + 64:  # forget finished groups
            self._next_round = {}
            for req in self.waiting:
                self._next_round[req.group] = req.turn[0] + 1

    def _validate(self, req: Request, seen: set[str]) -> str | None:
        """What only the rank knows: ids it still holds, and its KV capacity (the frontend
        validated the request itself)."""
        if req.rid in self.requests or req.rid in seen:
            return f"request id {req.rid!r} is already in use"
        # a decode engine's landing pages also hold the first decode's position
        landing = req.room is not None and self.role == "decode"
        need = self._blocks_for(req.prompt_len + landing)
        if need > self.pool.num_usable:
            return (
                f"the prompt needs {need} KV blocks but the cache has only {self.pool.num_usable}"
            )
        return None

    def _admit(
        self,
        plan: ExecutionPlan,
        rows: list[ScheduledRow],
        row_reqs: list[Request],
        budget: int,
    ) -> int:
        page = self.page_size
        tier = self.host_tier
        storage = self.storage
        while self.waiting and budget > 0 and self._free_slots:
            req = self.waiting[0]
            if req.image is not None:
                if not self._restore(plan, req):
                    break  # its stores are in flight, or the pool is full: it keeps its turn
                continue
            if req.num_pending:
                break  # retracted with tokens still in flight: re-admit once they land
            if req.room is not None and self.role == "decode":
                if not self._admit_remote(req, plan):
                    break  # its landing pages fit once residents give back their blocks
                continue
            hits: list[int] = []
            host_hits: list[int] = []
            if self.pool.enable_prefix_caching and not req.wants_prompt_logprobs:
                hash_full_blocks(req, page)
                # Never prepared: its QUERY, if it is planned now, makes it wait apart. (A
                # disaggregated request's pages belong to its transfer: not prepared.)
                if (
                    storage is not None
                    and not req.storage_settled
                    and req.room is None
                    and storage.prepare(plan, req)
                ):
                    self.waiting.popleft()
                    continue
                # At least the last token is recomputed: its logits sample the next one.
                keys = req.block_hashes[: (req.num_tokens - 1) // page]
                hits = self.pool.lookup(keys)
                if tier is not None and len(hits) < len(keys):
                    host_hits = tier.lookup(keys[len(hits) :])
            computed = (len(hits) + len(host_hits)) * page
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
            fresh = self.pool.allocate(need)
            if host_hits:  # loaded into its first fresh blocks; its forward reads them
                tier.plan_load(plan, req, host_hits, fresh[: len(host_hits)])
            if storage is not None:
                storage.admitted(req)  # what it fetched is referenced by its load now
            req.block_ids = hits + fresh
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
            rows.append(schedule_row(plan, req, n, req.num_tokens, owner, self.pool))
            row_reqs.append(req)
            budget -= n
        return budget

    def _restore(self, plan: ExecutionPlan, req: Request) -> bool:
        """Plan the restore of a retracted request's image into fresh blocks and a free
        slot; it runs again once the restore is acknowledged. False: not yet."""
        if not self.host_tier.restore_ready(req) or req.image.num_pages > self.pool.num_free:
            return False
        self.waiting.popleft()
        req.block_ids = self.pool.allocate(req.image.num_pages)
        req.slot = self._free_slots.pop()
        req.status = Status.RESTORING
        self.host_tier.plan_restore(plan, req, req.block_ids)
        return True
