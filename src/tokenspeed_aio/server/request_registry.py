"""The running HTTP requests, by their id and by each choice's engine rid: what
/abort_request reaches, what admission counts (``--max-waiting-sequences``) and what tells
the idle trim when the server goes idle. A request registers once (a streamed one before its
headers go out) and leaves when its last choice ended, it was cut off, or its response is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenspeed_aio.errors import RequestConflictError
from tokenspeed_aio.server.idle_trim import IdleTrim


class _Choice(Protocol):
    rid: str


class Registered(Protocol):
    """What the registry holds of a request (``generation.Fanout``)."""

    request_id: str
    jobs: Sequence[_Choice]

    def abort(self, rid: str | None = None) -> list[str]: ...


class RequestRegistry:
    """Running HTTP requests by their id and by each choice's engine rid, so that
    /abort_request can end either a whole request or one choice."""

    def __init__(self, idle: IdleTrim | None = None) -> None:
        self._by_id: dict[str, Registered] = {}
        self.requests = 0  # registered requests
        self.sequences = 0  # the choices of every registered request
        self.idle = idle  # told when the first request starts and the last one ends

    def add(self, request: Registered) -> None:
        """Register a request under its ids; RequestConflictError (nothing registered) when
        one of them is taken. The route checked them already, but two requests with one
        rid can both get through that check before either is registered."""
        keys = {request.request_id, *(job.rid for job in request.jobs)}
        taken = next((key for key in keys if key in self._by_id), None)
        if taken is not None:
            raise RequestConflictError(f"rid: request {taken!r} is already running", param="rid")
        if not self._by_id and self.idle is not None:
            self.idle.busy()
        for key in keys:
            self._by_id[key] = request
        self.requests += 1
        self.sequences += len(request.jobs)

    def remove(self, request: Registered) -> None:
        """Unregister ``request``; nothing when it is not registered (any more)."""
        if self._by_id.get(request.request_id) is not request:
            return
        self.requests -= 1
        self.sequences -= len(request.jobs)
        for key in (request.request_id, *(job.rid for job in request.jobs)):
            self._by_id.pop(key, None)  # a single choice's rid may be the request's id
        if not self._by_id and self.idle is not None:
            self.idle.idle()

    def running(self, request_id: str) -> bool:
        return request_id in self._by_id

    def abort(self, rid: str) -> list[str]:
        request = self._by_id.get(rid)
        if request is None:
            return []
        return request.abort(None if rid == request.request_id else rid)

    def abort_all(self) -> list[str]:
        return [rid for request in set(self._by_id.values()) for rid in request.abort()]
