"""The frontend's half of the control operations: one ControlCall to every replica under one
call id, the replies collected from the output wire, combined into one result.

A replica answers once its operation completed there (a wait pause once drained, a weight
update once loaded and agreed); the call resolves when every replica answered. A failure
anywhere is the call's failure; the message says which replica said what.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from tokenspeed_aio.errors import EngineError
from tokenspeed_aio.wire.control import ControlCall, ControlOp, ControlReply


@dataclass(frozen=True, slots=True)
class ControlResult:
    ok: bool
    message: str
    status: int  # 200, or the worst replica's (400, 409, 500, 503)
    weight_version: str
    replies: dict[int, ControlReply] = field(default_factory=dict)  # replica -> its reply


@dataclass
class _Pending:
    future: asyncio.Future[ControlResult]
    replies: dict[int, ControlReply] = field(default_factory=dict)


class ControlCalls:
    def __init__(self, num_replicas: int, weight_version: str) -> None:
        self.num_replicas = num_replicas
        self.weight_versions = dict.fromkeys(range(num_replicas), weight_version)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        # The state the last successful calls left (for health checks, not for decisions).
        self.paused: str | None = None
        self.released: set[str] = set()

    @property
    def weight_version(self) -> str:
        """The weights' version; replicas differ only while an update is between them."""
        return self.weight_versions[0]

    def start(self, op: ControlOp) -> tuple[ControlCall, asyncio.Future[ControlResult]]:
        call = ControlCall(next(self._ids), op)
        future = asyncio.get_running_loop().create_future()
        self._pending[call.call_id] = _Pending(future)
        return call, future

    def forget(self, call_id: int) -> None:
        self._pending.pop(call_id, None)

    def received(self, replica: int, replies: list[ControlReply]) -> None:
        for reply in replies:
            if reply.weight_version:
                self.weight_versions[replica] = reply.weight_version
            pending = self._pending.get(reply.call_id)
            if pending is None:
                continue  # its caller left; the engine still completed it
            pending.replies[replica] = reply
            if len(pending.replies) == self.num_replicas and not pending.future.done():
                pending.future.set_result(self._combine(pending.replies))
                del self._pending[reply.call_id]

    def fail_all(self, err: EngineError) -> None:
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(err)
        self._pending.clear()

    def _combine(self, replies: dict[int, ControlReply]) -> ControlResult:
        ordered = [replies[r] for r in sorted(replies)]
        failed = [(r, rep) for r, rep in sorted(replies.items()) if not rep.ok]
        if not failed:
            messages = {rep.message for rep in ordered}
            return ControlResult(
                True, " / ".join(sorted(messages)), 200, self.weight_version, replies
            )
        if len({rep.message for _, rep in failed}) == 1 and len(failed) == len(ordered):
            message = failed[0][1].message  # every replica said the same
        else:
            message = "; ".join(f"replica {r}: {rep.message}" for r, rep in failed)
        status = max(rep.status for _, rep in failed)
        return ControlResult(False, message, status, self.weight_version, replies)
