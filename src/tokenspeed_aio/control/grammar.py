"""The grammar queue: a constrained request waits here while its grammar compiles off
the round (on the backend's compiler threads), and is admitted once compiled -- with
several ranks, once compiled on every rank of the replica, in the same round on all
of them. A compile error or timeout on any rank fails the request with the
compiler's message; other requests keep running.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any, Protocol

from tokenspeed_aio.control.relay import ReplicaGroup
from tokenspeed_aio.grammar.spec import GrammarSpec, grammar_spec
from tokenspeed_aio.scheduler.request import Request

READY, PENDING = "ready", "pending"


class GrammarBackend(Protocol):
    def compile(self, spec: GrammarSpec) -> concurrent.futures.Future: ...

    def matcher(self, compiled: Any) -> Any: ...


@dataclass
class _Waiting:
    req: Request
    future: concurrent.futures.Future
    deadline: float


class GrammarQueue:
    def __init__(
        self,
        backend: GrammarBackend | None,
        timeout: float,
        group: ReplicaGroup | None = None,
        disabled: str | None = None,
    ) -> None:
        self.backend = backend
        # Why a constrained request is refused when there is no backend.
        self.disabled = disabled or "structured output is disabled (--grammar-backend none)"
        self.timeout = timeout
        self.group = group
        self._waiting: dict[str, _Waiting] = {}  # arrival order

    def __len__(self) -> int:
        return len(self._waiting)

    def enqueue(self, requests: list[Request]) -> list[tuple[Request, str]]:
        """Start compiling; returns the requests refused (grammars disabled)."""
        if self.backend is None:
            message = f"response_format: {self.disabled}"
            return [(req, message) for req in requests]
        for req in requests:
            fut = self.backend.compile(grammar_spec(req.params))
            self._waiting[req.rid] = _Waiting(req, fut, time.monotonic() + self.timeout)
        return []

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self._waiting.pop(rid, None)

    async def admit(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests compiled everywhere (matchers attached), and those that failed."""
        local = {rid: self._state(w) for rid, w in self._waiting.items()}
        views = [local] if self.group is None else await self.group.all_gather(local)
        ready, failed = [], []
        for rid, w in list(self._waiting.items()):
            states = [view.get(rid, PENDING) for view in views]
            error = next((s for s in states if s not in (READY, PENDING)), None)
            if error is not None:
                failed.append((w.req, error))
            elif all(s == READY for s in states):
                w.req.grammar = self.backend.matcher(w.future.result())
                ready.append(w.req)
            else:
                continue
            del self._waiting[rid]
        return ready, failed

    def _state(self, w: _Waiting) -> str:
        """READY, PENDING, or the error message (what the rank agreement exchanges)."""
        if w.future.done():
            err = w.future.exception()
            return READY if err is None else f"{grammar_spec(w.req.params).kind}: {err}"
        if time.monotonic() > w.deadline:
            return (
                f"{grammar_spec(w.req.params).kind}: the grammar did not compile within "
                f"{self.timeout:g} s (--grammar-compile-timeout-secs); make it smaller "
                "(fewer alternatives, smaller repetition bounds)"
            )
        return PENDING
