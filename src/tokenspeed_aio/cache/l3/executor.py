"""The L3 executor: host worker threads that run a rank's storage operations against its
L2 pages. No device access and no torch: the pages are a numpy byte view of the L2 host
pool, one row per host block.

The control thread submits (``submit``) and polls (``poll``); neither blocks on storage.
Each operation is reported exactly once: done, failed, timed out or cancelled. A worker
touches the L2 pages only under its operation's lock and only while the operation is still
open -- a PUT copies its pages out before the store call, a GET fetches into its own
buffer and copies in after -- so an operation that timed out or was cancelled can never
write a page the scheduler has given to someone else, even if its worker is still stuck
in the store. After the store failed a call (or one timed out) it is marked down:
operations fail at once ("store unavailable"), at submission or when a worker takes one
queued before, so no worker waits on a store that is down and no request waits longer
than the calls already in flight when it went down (their timeout). Meanwhile one prober
thread asks the store (a one-key existence check) every RETRY_SECONDS, one call at a time;
the first answer marks it up again, so a store that comes back is used again. Store calls
release the GIL (Mooncake's binding does: a hung master blocks only its worker or the
prober).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np

from tokenspeed_aio.cache.l3.backends import StorageBackend, StorageError
from tokenspeed_aio.cache.l3.identity import decode_object, encode_object, object_key
from tokenspeed_aio.control.storage import StorageReport, StorageResult
from tokenspeed_aio.scheduler.cache_ops import CancelOp, GetOp, PutOp, QueryOp, StorageOp

logger = logging.getLogger(__name__)

# Workers for the QUERYs and GETs a waiting request needs, and apart from them for the
# PUTs, so publishing never holds up a request's preparation.
DEFAULT_WORKERS = 3
PUT_WORKERS = 2
# While the store is marked down, the prober asks it again this long after its last answer
# (a failure; a call to a dead Mooncake master takes seconds to fail by itself).
RETRY_SECONDS = 1.0
PROBE_NAME = "probe"  # the key the prober looks up, in the deployment's namespace


class _Task:
    __slots__ = ("deadline", "lock", "op", "result", "submitted")

    def __init__(self, op: StorageOp, submitted: float, timeout: float) -> None:
        self.op = op
        self.submitted = submitted
        self.deadline = submitted + timeout
        self.lock = threading.Lock()
        self.result: StorageResult | None = None  # set once, under the lock


class L3Executor:
    def __init__(
        self,
        backend: StorageBackend,
        pages: np.ndarray,
        namespace: str,
        *,
        timeout: float,
        workers: int = DEFAULT_WORKERS,
    ) -> None:
        if pages.ndim != 2 or pages.dtype != np.uint8:
            raise ValueError("pages must be a [blocks, page bytes] uint8 view")
        self.backend = backend
        self.pages = pages
        self.namespace = namespace
        self.timeout = timeout
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()  # QUERY, GET
        self._puts: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._open: dict[int, _Task] = {}
        self._done: list[StorageResult] = []
        self._up = True  # False while the store is marked down (written under the lock)
        self._downs = 0  # times it was marked down: a probe answering an older one is stale
        self._down = threading.Condition(self._lock)  # wakes the prober
        self._closing = False
        self._threads = [
            threading.Thread(target=self._worker, args=(q,), name=f"ts-l3-{name}{i}", daemon=True)
            for q, name, n in ((self._queue, "", workers), (self._puts, "put", PUT_WORKERS))
            for i in range(n)
        ]
        self._threads.append(threading.Thread(target=self._prober, name="ts-l3-probe", daemon=True))
        for thread in self._threads:
            thread.start()

    # -- the control thread ------------------------------------------------------
    def submit(self, ops: Sequence[StorageOp]) -> None:
        now = time.monotonic()
        for op in ops:
            if isinstance(op, CancelOp):
                with self._lock:
                    task = self._open.get(op.op_id)
                if task is not None:
                    self._finish(task, StorageResult(op.op_id, False, 0, "cancelled"))
                continue
            task = _Task(op, now, self.timeout)
            with self._lock:
                self._open[op.op_id] = task
            if not self._up:
                self._finish(task, StorageResult(op.op_id, False, 0, "store unavailable"))
                continue
            (self._puts if isinstance(op, PutOp) else self._queue).put(task)

    def poll(self) -> StorageReport:
        """What completed since the last poll; operations past their deadline complete
        now, as timed out (their workers, if still in the store, write nothing after)."""
        now = time.monotonic()
        with self._lock:
            late = [t for t in self._open.values() if t.deadline <= now]
        for task in late:
            if self._finish(task, StorageResult(task.op.op_id, False, 0, "timed out")):
                self._mark_down()  # a store that hangs is down too
                logger.warning(
                    "L3 %s %d timed out after %.3g s", task.op.kind, task.op.op_id, self.timeout
                )
        with self._lock:
            done, self._done = self._done, []
            depth = len(self._open)
        return StorageReport(now, depth, done, self._up)

    def delete_namespace(self) -> None:
        """flush_cache: drop every object of this deployment (blocking; low rate)."""
        self.backend.delete_namespace(self.namespace)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._down.notify_all()
        for _ in range(len(self._threads)):
            self._queue.put(None)
            self._puts.put(None)
        for thread in self._threads:
            thread.join(timeout=1.0)  # a worker stuck in the store is a daemon
        self.backend.close()

    # -- the store's state -------------------------------------------------------------
    def _mark_down(self) -> None:
        with self._lock:
            self._downs += 1
            if self._up:
                self._up = False
                logger.warning("L3 store marked down: its operations fail at once until it answers")
                self._down.notify_all()

    def _prober(self) -> None:
        key = f"{self.namespace}/{PROBE_NAME}"
        while True:
            with self._lock:
                while self._up and not self._closing:
                    self._down.wait()
                if self._closing:
                    return
                self._down.wait(RETRY_SECONDS)  # a close ends the wait early
                if self._closing:
                    return
                downs = self._downs
            try:
                self.backend.exists([key])
            except Exception as err:  # still down: ask again after RETRY_SECONDS
                logger.debug("L3 store probe failed: %s", err)
                continue
            with self._lock:
                if self._downs == downs and not self._up:  # no failure since it asked
                    self._up = True
                    logger.warning("L3 store answers again: operations go to it")

    # -- workers ----------------------------------------------------------------------
    def _finish(self, task: _Task, result: StorageResult) -> bool:
        """Complete ``task`` once; False when it already was."""
        with task.lock:
            if task.result is not None:
                return False
            task.result = _timed(result, time.monotonic() - task.submitted)
        with self._lock:
            self._open.pop(task.op.op_id, None)
            self._done.append(task.result)
        return True

    def _worker(self, tasks: queue.SimpleQueue) -> None:
        while (task := tasks.get()) is not None:
            if task.result is not None:
                continue  # cancelled or timed out while queued
            op = task.op
            if not self._up:  # queued before the store was marked down
                self._finish(task, StorageResult(op.op_id, False, 0, "store unavailable"))
                continue
            try:
                if isinstance(op, QueryOp):
                    result = self._query(op)
                elif isinstance(op, GetOp):
                    result = self._get(task, op)
                else:
                    result = self._put(task, op)
            except Exception as err:  # the store's failure: counted, the request recomputes
                logger.warning("L3 %s %d failed: %s", op.kind, op.op_id, err)
                if isinstance(err, StorageError):
                    self._mark_down()
                result = StorageResult(op.op_id, False, 0, f"{type(err).__name__}: {err}")
            if result is not None:
                self._finish(task, result)

    def _key(self, key: tuple) -> str:
        return object_key(self.namespace, key[0])

    def _query(self, op: QueryOp) -> StorageResult:
        found = self.backend.exists([self._key(k) for k in op.keys])
        hits = next((i for i, f in enumerate(found) if not f), len(found))
        return StorageResult(op.op_id, True, hits)

    def _get(self, task: _Task, op: GetOp) -> StorageResult | None:
        page_bytes = self.pages.shape[1]
        values = self.backend.get_many([self._key(k) for k in op.keys])
        if any(value is None for value in values):
            return StorageResult(op.op_id, False, 0, "object missing")
        fetched = [decode_object(v, *k, page_bytes) for k, v in zip(op.keys, values)]
        with task.lock:
            if task.result is not None:
                return None
            for block, page in zip(op.host_blocks, fetched):
                self.pages[block] = np.frombuffer(page, np.uint8)
        return StorageResult(op.op_id, True, page_bytes * len(fetched))

    def _put(self, task: _Task, op: PutOp) -> StorageResult | None:
        with task.lock:
            if task.result is not None:
                return None
            values = [
                encode_object(*key, memoryview(self.pages[block]))
                for key, block in zip(op.keys, op.host_blocks)
            ]
        self.backend.put_many([self._key(k) for k in op.keys], values)
        return StorageResult(op.op_id, True, self.pages.shape[1] * len(values))


def _timed(result: StorageResult, seconds: float) -> StorageResult:
    return StorageResult(result.op_id, result.ok, result.value, result.error, seconds)
