"""The control subsystem: pause and continue, memory release and resume, profiling, and the
queue of weight operations only the same-round gate completes (control/weight_gate.py).

It enters the round as one call at the head, ``gate``, after admission: the round's
control calls are applied in arrival order among its requests (a call and the requests
before it keep their order), held requests are released when admission reopens, drains
that finished are answered, a release whose drain finished runs, and the gated weight
operation due this round runs. The round applies what it returns (``ControlStep``): the
requests to admit, aborts, a prefix-cache flush, the forward permission. The replies go out
at the tail with the round's outputs (``take_replies``).

    pause keep   freeze: a frozen round commits what is dispatched, plans no forward, still
                 joins the DP agreement; answered at once
    pause wait   hold admission, let what runs finish; answered once drained
    pause abort  hold admission, abort what runs; answered once drained
    release      refused under a keep pause and while a weight operation is queued; drains
                 like wait, then frees its regions on the forward thread (with attention DP
                 once every rank is drained and holding admission); frozen until resumed

With attention DP the gate decides from the previous round's DP exchange, where every rank
shares ``share()`` (its gated head, release intent, readiness, released regions): the
decision is rank-identical and ordinary rounds add no collective.
"""

from __future__ import annotations

import logging
from collections import deque

from tokenspeed_aio.control.control_step import ControlStep, ControlView
from tokenspeed_aio.control.data_plane import DataPlane
from tokenspeed_aio.control.ingress import Admission
from tokenspeed_aio.control.output import refusal
from tokenspeed_aio.control.weight_gate import GatedOps, ReductionGroup
from tokenspeed_aio.errors import EngineError
from tokenspeed_aio.scheduler.request import Request
from tokenspeed_aio.wire.control import (
    GATED,
    MEMORY_TAGS,
    PAUSE_MODES,
    ContinueGeneration,
    ControlCall,
    ControlReply,
    PauseGeneration,
    ReleaseMemory,
    ResumeMemory,
    StartProfile,
    StopProfile,
)

logger = logging.getLogger(__name__)

_FAILED = object()  # a data-plane operation failed (and its call was answered)

# (gated head call id or -1, release pending, ready for a release, regions released)
GateShare = tuple[int, bool, bool, bool]


class Control:
    def __init__(
        self,
        device: DataPlane,
        group: ReductionGroup | None = None,
        *,
        dp: bool = False,
        weight_version: str = "default",
    ) -> None:
        self.device = device
        self.dp = dp  # decide from the DP exchange's shares (attention DP)
        self.pause: str | None = None  # the pause in force: abort | wait | keep
        self.held: list[Request] = []  # admitted while admission is held, arrival order
        self._held_rids: set[str] = set()
        self.drain_waiters: list[ControlCall] = []  # pause wait/abort calls, answered once drained
        self._new_waiters: set[int] = set()  # arrived this round: answered from the next one
        self.releases: deque[ControlCall] = deque()  # releases waiting for their drain
        self.released: set[str] = set()  # regions whose memory is freed now
        self.gated = GatedOps(device, group)
        self.weight_version = weight_version
        self._replies: list[ControlReply] = []

    # -- what the round asks -----------------------------------------------------------
    @property
    def holding(self) -> bool:
        """Admission is held: requests that arrive wait here."""
        return bool(self.pause or self.releases or self.released or self.gated.invalid)

    @property
    def frozen(self) -> bool:
        """No forward may run: a keep pause, released memory, weights invalidated."""
        return self.pause == "keep" or bool(self.released) or self.gated.invalid is not None

    @property
    def busy(self) -> bool:
        """Something progresses without new messages: the round must not wait for them."""
        return bool(self.drain_waiters or self.releases or self.gated.queue)

    def holds(self, rid: str) -> bool:
        return rid in self._held_rids

    def share(self, drained: bool) -> GateShare:
        """This rank's part of the round's DP exchange."""
        return (
            self.gated.head_id,
            bool(self.releases),
            self.holding and drained,
            bool(self.released),
        )

    def end_held(self) -> list:
        """At stop: the held requests end with an abort (they never reached the scheduler)."""
        ended = [refusal(req.rid, 0, None, reason="abort") for req in self.held]
        self.held, self._held_rids = [], set()
        return ended

    def take_replies(self) -> list[ControlReply]:
        replies, self._replies = self._replies, []
        return replies

    # -- the head gate ---------------------------------------------------------------------
    async def gate(
        self, adm: Admission, view: ControlView, shares: list[GateShare] | None
    ) -> ControlStep:
        step = ControlStep(adm.requests, adm.constrained)
        self.gated.fresh.clear()
        self._new_waiters.clear()
        if adm.aborted and self._held_rids:
            self._drop_held(adm.aborted, step)
        if adm.calls:
            step.requests, step.constrained = [], []
            await self._arrivals(adm, view, step)
        elif self.holding and (adm.requests or adm.constrained):
            self._hold(adm.requests + adm.constrained, step)
            step.requests, step.constrained = [], []
        if self.held and not self.holding:
            self._release_held(step)
        if self.drain_waiters and view.drained:
            # Not one that arrived this round: what came before it (admitted now, or aborted
            # by it) has not run or ended yet.
            for call in self.drain_waiters:
                if call.call_id not in self._new_waiters:
                    self._reply(call, True, "generation paused")
            self.drain_waiters = [c for c in self.drain_waiters if c.call_id in self._new_waiters]
        if self.releases:
            await self._run_releases(view, shares, step)
        if self.gated.queue:
            await self.gated.run_due(view, shares if self.dp else None, step, self)
        any_released = bool(self.released) or any(s[3] for s in shares or ())
        step.allow_forward = not self.frozen and not any_released
        step.idle_forward = not any_released
        return step

    async def _arrivals(self, adm: Admission, view: ControlView, step: ControlStep) -> None:
        """The round's requests and calls in arrival order: a request that arrives while
        admission is held waits; one before the call that holds it is admitted."""
        items: list[tuple[int, Request | ControlCall]] = list(adm.calls)
        items += [(adm.positions[r.rid], r) for r in adm.requests + adm.constrained]
        items.sort(key=lambda item: item[0])
        for _, item in items:
            if isinstance(item, ControlCall):
                await self._call(item, view, step)
            elif self.holding:
                self._hold([item], step)
            else:
                (step.constrained if item.params.has_grammar else step.requests).append(item)

    def _hold(self, requests: list[Request], step: ControlStep) -> None:
        if self.gated.invalid is not None:  # nothing will run again: refuse, do not hold
            step.refusals += [refusal(r.rid, 503, self.gated.invalid) for r in requests]
            return
        self.held += requests
        self._held_rids.update(r.rid for r in requests)

    def _drop_held(self, rids: list[str], step: ControlStep) -> None:
        """Client aborts of held requests: they end here, never admitted."""
        gone = self._held_rids.intersection(rids)
        if gone:
            self.held = [r for r in self.held if r.rid not in gone]
            self._held_rids -= gone
            step.refusals += [refusal(rid, 0, None, reason="abort") for rid in gone]

    def _release_held(self, step: ControlStep) -> None:
        for req in self.held:
            (step.constrained if req.params.has_grammar else step.requests).append(req)
        self.held, self._held_rids = [], set()

    # -- immediate calls -------------------------------------------------------------------
    async def _call(self, call: ControlCall, view: ControlView, step: ControlStep) -> None:
        op = call.op
        if isinstance(op, GATED):
            problem = self.gated.check_arguments(op)
            if problem:
                self._reply(call, False, problem, 400)
            else:
                self.gated.queue.append(call)
                self.gated.fresh.add(call.call_id)
        elif isinstance(op, PauseGeneration):
            self._pause(call, op, step)
        elif isinstance(op, ContinueGeneration):
            for waiter in self.drain_waiters:
                self._reply(
                    waiter, False, "continue_generation ended the pause before it drained", 409
                )
            self.drain_waiters.clear()
            self.pause = None
            self._reply(call, True, "generation continued")
        elif isinstance(op, ReleaseMemory):
            self._release(call, op)
        elif isinstance(op, ResumeMemory):
            await self._resume(call, op)
        elif isinstance(op, StartProfile | StopProfile):
            await self._profile(call, op)
        else:  # a new op kind the frontend sends but this rank does not know
            self._reply(call, False, f"unsupported control operation {type(op).__name__}", 400)

    def _pause(self, call: ControlCall, op: PauseGeneration, step: ControlStep) -> None:
        if op.mode not in PAUSE_MODES:
            self._reply(call, False, f"mode: must be one of {', '.join(PAUSE_MODES)}", 400)
            return
        if self.releases or self.released:
            what = ", ".join(sorted(self.released | _tags_of(self.releases)))
            self._reply(call, False, f"memory is released ({what}): resume it first", 409)
            return
        if op.mode == "keep":
            for waiter in self.drain_waiters:
                self._reply(
                    waiter, False, "a keep pause replaced this pause before it drained", 409
                )
            self.drain_waiters.clear()
            self.pause = "keep"
            self._reply(call, True, "generation frozen")
            return
        self.pause = op.mode
        step.abort_all = step.abort_all or op.mode == "abort"
        self.drain_waiters.append(call)
        self._new_waiters.add(call.call_id)

    def _release(self, call: ControlCall, op: ReleaseMemory) -> None:
        tags = op.tags or list(MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        pending = _tags_of(self.releases)
        problem = None
        if unknown:
            problem = (400, f"tags: unknown {unknown}; the regions are {list(MEMORY_TAGS)}")
        elif self.pause == "keep":
            problem = (
                409,
                "a keep pause is in force: its frozen requests would run in the release's "
                "drain; continue, or pause with mode wait or abort, first",
            )
        elif self.gated.queue:
            problem = (
                409,
                f"{len(self.gated.queue)} weight operation(s) are in flight; release once "
                "they completed",
            )
        elif self.gated.invalid is not None:
            problem = (409, self.gated.invalid)
        else:
            again = [t for t in tags if t in self.released or t in pending]
            if again:
                problem = (409, f"tags: {again} already released (or releasing)")
        if problem:
            self._reply(call, False, problem[1], problem[0])
        else:
            call.op.tags = tags
            self.releases.append(call)

    async def _resume(self, call: ControlCall, op: ResumeMemory) -> None:
        if not op.tags and not self.released:
            self._reply(call, True, "nothing is released")  # a no-op, also while draining
            return
        tags = op.tags or sorted(self.released)
        missing = [t for t in tags if t not in self.released]
        if missing:
            pending = [t for t in missing if t in _tags_of(self.releases)]
            why = "has not run yet (still draining)" if pending else "is not released"
            self._reply(call, False, f"tags: the release of {missing} {why}", 409)
            return
        if await self._on_device(call, self.device.resume_memory(tags), "resume") is not _FAILED:
            self.released.difference_update(tags)
            self._reply(call, True, f"resumed {tags}")

    async def _run_releases(
        self, view: ControlView, shares: list[GateShare] | None, step: ControlStep
    ) -> None:
        """Releases run once drained: here, and with attention DP on every rank (each rank
        holding admission and drained as of the last exchange), so no peer can still admit."""
        if not view.drained or (self.dp and not (shares and all(s[2] for s in shares))):
            return  # (no shares yet: the first round has had no exchange)
        while self.releases:
            call = self.releases.popleft()
            tags = call.op.tags
            if await self._on_device(call, self.device.release_memory(tags), "release") is _FAILED:
                continue
            self.released.update(tags)
            # The KV contents are gone: so are the prefix cache's entries (the scheduler
            # holds no block now, so the reset runs).
            step.flush_cache = step.flush_cache or "kv_cache" in tags
            self._reply(call, True, f"released {tags}")

    async def _profile(self, call: ControlCall, op: StartProfile | StopProfile) -> None:
        if isinstance(op, StartProfile):
            if await self._on_device(call, self.device.start_profile(op), "profile") is not _FAILED:
                self._reply(call, True, f"profiling the forward thread into {op.output_dir}")
        else:
            trace = await self._on_device(call, self.device.stop_profile(), "stop_profile")
            if trace is not _FAILED:
                self._reply(call, True, trace)

    async def _on_device(self, call: ControlCall, awaitable, what: str):
        """Await a data-plane operation for its result; on failure answer ``call`` (a refusal
        with its own status, else 500) and return _FAILED."""
        try:
            result = await awaitable
        except EngineError as err:
            self._reply(call, False, err.message, err.status)
            return _FAILED
        except Exception as err:
            logger.exception("%s failed on the data plane", what)
            self._reply(call, False, f"{what} failed: {err}", 500)
            return _FAILED
        return result

    def _reply(self, call: ControlCall, ok: bool, message: str = "", status: int = 200) -> None:
        self._replies.append(
            ControlReply(call.call_id, ok, message, status if not ok else 200, self.weight_version)
        )

    reply = _reply  # the gated queue answers through the same path


def _tags_of(calls: deque[ControlCall]) -> set[str]:
    return {tag for call in calls for tag in call.op.tags}
