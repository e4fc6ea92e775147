"""The same-round gate's queue: cache flushes and the weight operations (trainer-group init
and teardown, updates from disk, from tensors, by broadcast).

Each op is queued on arrival and completes only in a round where every rank holds it at
its queue's head -- with attention DP that is read off the previous round's DP exchange,
otherwise the replica's relay already made every member's queue the same. The device
call blocks in a collective the trainer drives: a DP peer that had not dequeued its copy
yet would wait for this rank in the next round's agreement, a deadlock; the gate makes
every rank enter together. One op completes per round.

An op runs in three agreed steps, so no rank acts on what a peer refused:

1. prerequisites, MIN-reduced: this rank's state (weights resident, no request holding KV
   blocks when the op flushes) and, for an update, the data plane's staging (names and
   shapes checked, this rank's payload decoded, a broadcast's tensors received). A refusal
   anywhere: no rank flushes or loads, every rank's weights and caches stay as they were,
   every replica says why (a trainer lost mid-broadcast: 502, the old weights serve on).
2. the device call (the load), then its result MIN-reduced;
3. the commit on every forward thread: the new weights are usable, or -- one rank failed,
   some may have loaded part -- invalid on every rank until restart, which every reply says.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Protocol

from tokenspeed_aio.control.control_step import ControlStep, ControlView
from tokenspeed_aio.control.data_plane import DataPlane
from tokenspeed_aio.wire.control import (
    BROADCAST_FAILED,
    WEIGHT_UPDATES,
    ControlCall,
    DestroyWeightsGroup,
    FlushCache,
    InitWeightsGroup,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
)

logger = logging.getLogger(__name__)

# dtype names a distributed update may carry (torch's, without the "torch." prefix)
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8")
Problem = tuple[int, str] | None  # (HTTP-like status, why) of a refusal or failure


class ReductionGroup(Protocol):
    """The ranks that agree (collective.Group: the DP world, else the replica)."""

    ranks: tuple[int, ...]

    async def all_gather(
        self, value: object, *, error: str | None = None, timeout: float | None = None
    ) -> list: ...


class Replier(Protocol):
    """The control subsystem's state a gated op reads and the reply path it answers by."""

    released: set[str]
    weight_version: str

    def reply(self, call: ControlCall, ok: bool, message: str = "", status: int = 200) -> None: ...


class GatedOps:
    def __init__(self, device: DataPlane, group: ReductionGroup | None) -> None:
        self.device = device
        self.group = group
        self.queue: deque[ControlCall] = deque()
        self.fresh: set[int] = set()  # call ids queued this round: due from the next one on
        self.groups: set[str] = set()  # trainer groups this rank joined (rank-identical)
        self.invalid: str | None = None  # set once a load failed anywhere: nothing runs again

    @property
    def head_id(self) -> int:
        return self.queue[0].call_id if self.queue else -1

    @staticmethod
    def check_arguments(op: object) -> str | None:
        """What is wrong with the call itself: the same answer on every rank, so it is
        refused at once, without the gate."""
        if isinstance(op, UpdateWeightsFromDistributed):
            if not op.names:
                return "names: at least one tensor"
            if not len(op.names) == len(op.dtypes) == len(op.shapes):
                return "names, dtypes and shapes: one of each per tensor"
            bad = [d for d in op.dtypes if d.removeprefix("torch.") not in DTYPE_NAMES]
            if bad:
                return f"dtypes: {bad[0]!r} is not one of {', '.join(DTYPE_NAMES)}"
        elif isinstance(op, UpdateWeightsFromTensor):
            if not op.payloads:
                return "serialized_named_tensors: at least one payload"
            if op.load_format not in (None, "safetensors"):
                return f"load_format: {op.load_format!r} is not supported (null or safetensors)"
        elif isinstance(op, UpdateWeightsFromDisk):
            if not op.model_path:
                return "model_path: required"
            if op.load_format not in (None, "auto", "safetensors"):
                return f"load_format: {op.load_format!r} is not one of auto, safetensors"
        elif isinstance(op, InitWeightsGroup):
            if op.world_size < 2 or not 0 < op.rank_offset < op.world_size:
                return "world_size and rank_offset: the trainer is rank 0 of world_size ranks"
            if not 0 < op.master_port < 65536:
                return f"master_port: {op.master_port} is not a port"
            if op.backend not in (None, "nccl", "gloo"):
                return f"backend: {op.backend!r} is not nccl or gloo"
            if not 0 < op.timeout_seconds < math.inf:
                return f"timeout_seconds: {op.timeout_seconds} is not a positive number of seconds"
        return None

    async def run_due(
        self,
        view: ControlView,
        shares: list[tuple] | None,
        step: ControlStep,
        control: Replier,
    ) -> None:
        """Run the head op if it is due on every rank this round (at most one per round).

        An op never runs in the round it arrived: the aborts that came before it (an
        update with abort_all_requests) took effect at that round's head by then."""
        head = self.queue[0]
        if head.call_id in self.fresh:
            return
        if shares is not None:
            heads = [share[0] for share in shares]
            if not heads or -1 in heads:
                return  # no exchange yet, or a peer has not received it yet
            if any(h != head.call_id for h in heads):
                self.queue.popleft()
                message = f"control operations reached the ranks in different orders: {heads}"
                logger.error(message)
                control.reply(head, False, message, 500)
                return
        self.queue.popleft()
        await self._run(head, view, step, control)

    async def _run(
        self, call: ControlCall, view: ControlView, step: ControlStep, control: Replier
    ) -> None:
        op = call.op
        problem = self._prerequisite(op, view, control)
        staged = False
        if problem is None and isinstance(op, WEIGHT_UPDATES):
            staged = True
            error = await _attempt(self.device.stage_weights(op))
            status = 502 if error is not None and error.startswith(BROADCAST_FAILED) else 400
            problem = _as_problem(error, status)
        problem = await self._agree(problem)
        if problem is not None:
            if staged:
                await self.device.commit_weights(None)  # drop what was staged
            control.reply(call, False, problem[1], problem[0])
            return
        if isinstance(op, FlushCache):
            # The L3 namespace goes first, agreed: a failure on any rank flushes nothing.
            error = await _attempt(self.device.delete_storage())
            problem = await self._agree(_as_problem(error, 500))
            if problem is not None:
                control.reply(call, False, f"flush_cache: the L3 store: {problem[1]}", 500)
                return
            step.flush_cache = True
            control.reply(call, True, "cache flushed")
        elif isinstance(op, InitWeightsGroup | DestroyWeightsGroup):
            await self._group_op(call, control)
        else:
            await self._load(call, step, control)

    def _prerequisite(self, op: object, view: ControlView, control: Replier) -> Problem:
        if self.invalid is not None:
            return (503, self.invalid)
        flush = isinstance(op, FlushCache) or getattr(op, "flush_cache", False)
        if flush and not view.can_clear_cache:
            return (
                409,
                "flush_cache: requests still hold KV blocks; pause generation (mode wait or "
                "abort) first, or update with flush_cache false",
            )
        if isinstance(op, WEIGHT_UPDATES) and "weights" in control.released:
            return (
                409,
                "the weights are released: resume them (resume_memory_occupation with tags "
                '["weights"]) before updating them',
            )
        if isinstance(op, InitWeightsGroup) and op.group_name in self.groups:
            return (409, f"group_name: {op.group_name!r} is already initialized")
        named = isinstance(op, DestroyWeightsGroup | UpdateWeightsFromDistributed)
        if named and op.group_name not in self.groups:
            return (409, f"group_name: no weight update group {op.group_name!r}; init it first")
        return None

    async def _group_op(self, call: ControlCall, control: Replier) -> None:
        op = call.op
        if isinstance(op, InitWeightsGroup):
            error = await _attempt(self.device.init_weights_group(op))
        else:
            error = await _attempt(self.device.destroy_weights_group(op.group_name))
        problem = await self._agree(_as_problem(error, 500), timeout=math.inf)
        if isinstance(op, InitWeightsGroup):
            if problem is None:
                self.groups.add(op.group_name)
            elif error is None:  # joined here while a peer failed: leave again
                await _attempt(self.device.destroy_weights_group(op.group_name))
        else:
            self.groups.discard(op.group_name)
        if problem is None:
            control.reply(call, True, f"{type(op).__name__}: {op.group_name}")
        else:
            control.reply(call, False, problem[1], problem[0])

    async def _load(self, call: ControlCall, step: ControlStep, control: Replier) -> None:
        op = call.op
        error = await _attempt(self.device.load_staged_weights())
        problem = await self._agree(_as_problem(error, 500), timeout=math.inf)
        if problem is None:
            await self.device.commit_weights(True)
            control.weight_version = op.weight_version or control.weight_version
            step.flush_cache = op.flush_cache
            if op.flush_cache:  # the L3 objects were computed with the old weights
                await _attempt(self.device.delete_storage())
            control.reply(call, True, "weights updated")
            return
        await self.device.commit_weights(False)
        self.invalid = (
            f"the weights are invalid on every rank: a weight update failed ({problem[1]}); "
            "restart the engine"
        )
        logger.error(self.invalid)
        step.abort_all = True
        control.reply(call, False, self.invalid, 500)

    async def _agree(self, problem: Problem, timeout: float | None = None) -> Problem:
        """The first refusal across the group, in rank order (None: every rank is ready)."""
        if self.group is None:
            return problem
        shares = await self.group.all_gather(
            None if problem is None else list(problem), timeout=timeout
        )
        for rank, share in zip(self.group.ranks, shares):
            if share is not None:
                return (share[0], f"rank {rank}: {share[1]}")
        return None


async def _attempt(awaitable) -> str | None:
    """Await a data-plane call; its failure as a message (None when it succeeded or
    answered None)."""
    try:
        result = await awaitable
    except Exception as err:
        logger.exception("control operation failed on the data plane")
        return f"{type(err).__name__}: {err}"
    return result if isinstance(result, str) else None


def _as_problem(error: str | None, status: int) -> Problem:
    return None if error is None else (status, error)
