"""Give the allocator's free memory back to the system when the server goes idle.

A burst -- a slow client's backlog, a fan-out of thousands of sequences -- leaves
glibc's heap with free chunks between live ones, and glibc returns only the top of
its heap by itself: the frontend's RSS would stay at the burst's level. When the last
running request ends, ``IdleTrim`` runs a full garbage collection (what the burst left
in reference cycles -- a cancelled stream's frames and buffers -- is freed only by a
collection, which an idle server's allocations never trigger) and then ``malloc_trim(0)``
(which releases every free page of every arena), once the server has stayed idle for
``delay`` seconds, at most once per ``interval``. The collection holds the event loop
for its length (the frontend's startup heap is frozen, so it walks only what the load
left). Where the C library has no ``malloc_trim`` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable


def libc_malloc_trim() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)`` (1: memory was released), or None without it."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class IdleTrim:
    def __init__(
        self,
        trim: Callable[[], int] | None = None,
        delay: float = 1.0,
        interval: float = 10.0,
    ) -> None:
        self.trim = trim if trim is not None else libc_malloc_trim()
        self.delay = delay
        self.interval = interval
        self.trims = 0
        self._last = -interval
        self._timer: asyncio.TimerHandle | None = None

    def busy(self) -> None:
        """A request started: an idle trim still pending is not due any more."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def idle(self) -> None:
        """The last running request ended (call on the event loop)."""
        if self.trim is None or self._timer is not None:
            return
        wait = max(self.delay, self._last + self.interval - time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(wait, self._run)

    def _run(self) -> None:
        self._timer = None
        gc.collect()
        self.trim()
        self._last = time.monotonic()  # the interval runs from the end of this trim
        self.trims += 1
