"""The scheduler's half of prefill/decode disaggregation: a request's KV transfer as
scheduler state (torch-free, like the rest of the scheduler).

A request with a ``room`` is half of a disaggregated request:

* **Decode engine** -- admission gives it landing pages (the prompt plus the position
  of its first decode) and a slot, status TRANSFERRING, and a ``RemotePrefill`` in the
  plan: the transfer peer tells the prefill ranks where to write. No forward runs for
  it until ``TransferLanded`` brings the first token; its first decode row then sets
  up the slot (``_schedule_landed``) and it decodes as a plain request.
* **Prefill engine** -- it prefills as usual (with prefix reuse) but samples one token
  (ingress caps ``max_output`` at 1). When the result of the row that ends its prompt
  lands, the commit hands it off (``_hand_off``): it leaves the running set and its
  slot, keeps its pages, and the next plan carries a ``RemoteDecode`` with the first
  token and its logprobs. Planning it this late removes a dependency instead of
  registering one: the send never waits on a forward still in flight.

Either side keeps the pages until the replica agreed that every transfer job retired
(``TransferRetired``): a failure or a client abort only parks the request
(``TransferFailed``), since remote writes may still be queued or executing.
"""

from __future__ import annotations

import time
from collections import deque

from tokenspeed_aio.scheduler.plan import (
    ExecutionPlan,
    ForwardCommitted,
    NewSlotOwner,
    RemoteDecode,
    RemotePrefill,
    ScheduledRow,
)
from tokenspeed_aio.scheduler.prefix_cache import publish_full_blocks
from tokenspeed_aio.scheduler.request import Request, Status
from tokenspeed_aio.scheduler.rows import schedule_row
from tokenspeed_aio.scheduler.state import SchedulerState

ROLES = ("plain", "prefill", "decode")


class TransferMixin(SchedulerState):
    def _init_transfers(self) -> None:
        # plan id -> (request, its index among the plan's sampling rows) of the rows that
        # end a disaggregated prompt (prefill engine)
        self._handoffs: dict[int, list[tuple[Request, int]]] = {}
        self._outbound: list[RemoteDecode] = []  # hand-offs the next plan carries
        self._landed: deque[Request] = deque()  # decode: KV landed, first row not planned

    # -- decode engine ------------------------------------------------------------------
    def _admit_remote(self, req: Request, plan: ExecutionPlan) -> bool:
        """Landing pages and a slot for a request whose prompt KV arrives from the prefill
        engine; False when they do not fit yet."""
        need = self._blocks_for(req.prompt_len + 1)
        if need > self.pool.num_free or not self._free_slots:
            return False
        self.waiting.popleft()
        req.block_ids = self.pool.allocate(need)
        req.slot = self._free_slots.pop()
        req.status = Status.TRANSFERRING
        req.queue_seconds = time.monotonic() - req.submitted_at
        pages = tuple(req.block_ids[: self._blocks_for(req.prompt_len)])
        plan.remote_prefill.append(RemotePrefill(req.rid, req.room, pages, req.prompt_len))
        return True

    def _land(self, rid: str, token: int) -> None:
        req = self.requests.get(rid)
        if req is None or req.status is not Status.TRANSFERRING or req.room is None:
            return
        req.token_ids.append(token)
        req.num_computed = req.prompt_len
        req.room = None  # a plain request from here (a retraction recomputes it locally)
        publish_full_blocks(self.pool, req)
        self._landed.append(req)

    def _schedule_landed(
        self, plan: ExecutionPlan, rows: list[ScheduledRow], row_reqs: list[Request], budget: int
    ) -> int:
        """The first decode of each landed request: one position (its input is the
        bootstrap token, which the host holds), and the slot's new owner."""
        while self._landed and budget > 0:
            req = self._landed.popleft()
            owner = NewSlotOwner(
                params=req.params,
                seed=req.seed,
                prompt_token_ids=req.token_ids[: req.prompt_len],
                output_token_ids=req.token_ids[req.prompt_len :],
            )
            req.status = Status.RUNNING
            self.running.append(req)
            rows.append(schedule_row(plan, req, 1, req.num_tokens, owner, self.pool))
            row_reqs.append(req)
            budget -= 1
        return budget

    # -- prefill engine -----------------------------------------------------------------
    def _note_handoffs(
        self, plan: ExecutionPlan, rows: list[ScheduledRow], row_reqs: list[Request], first: int
    ) -> None:
        """Remember the rows that end a disaggregated prompt (``first``: how many sampling
        rows precede these prefill rows in the plan)."""
        found = []
        index = first
        for row, req in zip(rows, row_reqs):
            if row.sample:
                if req.room is not None:
                    found.append((req, index))
                index += 1
        if found:
            self._handoffs[plan.plan_id] = found

    def _hand_off(self, event: ForwardCommitted) -> None:
        for req, index in self._handoffs.pop(event.plan_id, ()):
            if req.status is not Status.RUNNING or req.room is None:
                continue  # parked or finished while the row was in flight
            if len(req.token_ids) <= req.prompt_len:
                continue  # its token was dropped: it ended meanwhile
            self.running.remove(req)
            self._free_slots.append(req.slot)
            req.slot = -1
            req.status = Status.TRANSFERRING
            first = req.token_ids[req.prompt_len]
            logprobs = None
            asked = event.logprobs is not None and req.params.logprobs is not None
            if asked and event.tokens[index] == first:  # not recomputed after a retraction
                logprobs = event.logprobs[index]
            pages = tuple(req.block_ids[: self._blocks_for(req.prompt_len)])
            self._outbound.append(
                RemoteDecode(req.rid, req.room, pages, req.prompt_len, first, logprobs)
            )

    def _plan_transfers(self, plan: ExecutionPlan) -> None:
        if self._outbound:
            plan.remote_decode, self._outbound = self._outbound, []

    # -- both ---------------------------------------------------------------------------
    def _park(self, req: Request) -> None:
        """Plan nothing more for a request whose transfer failed or was cancelled, but keep
        its pages (and slot) until the transfer retired."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is not Status.TRANSFERRING:
            return
        req.status = Status.TRANSFERRING
        self._unqueue(req)

    def _unqueue(self, req: Request) -> None:
        """Forget a landing or a hand-off not planned yet."""
        if req in self._landed:
            self._landed.remove(req)
        if any(out.rid == req.rid for out in self._outbound):
            self._outbound = [out for out in self._outbound if out.rid != req.rid]

    def _retire(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None or req.status is Status.FINISHED:
            return
        req.room = None
        self._park(req)
        self._finish(req)

    def _transfers_pending(self) -> bool:
        return bool(self._outbound or self._landed)
