"""When cache ops landed: the data plane's side of the acknowledgments.

On CUDA each submitted op's copies end with an event; a thread of its own waits on those
events in submission order (``event.synchronize`` releases the GIL) and records each
landed op once. The control thread's completion query (``poll``) only reads what was
recorded, under a lock, so the ids and the landed count it returns agree. On CPU the
copies ran by the time they were submitted: they land at once.
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from tokenspeed_aio.control.cache_ops import CacheResults
from tokenspeed_aio.control.faults import CacheAckFault

logger = logging.getLogger(__name__)


class Completions:
    def __init__(self, cuda: bool, fault: CacheAckFault | None = None) -> None:
        self._lock = threading.Lock()
        self._acks: list[int] = []
        self._landed = 0
        self._fault = fault
        self._error: BaseException | None = None
        self._waits: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if cuda:
            self._waits = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._wait_main, name="ts-cache-landing", daemon=True
            )
            self._thread.start()

    def submitted(self, op_ids: list[int], event: torch.cuda.Event | None) -> None:
        """The ops' copies are enqueued; ``event`` (None on CPU) completes after them."""
        if not op_ids:
            return
        if self._waits is None or event is None:
            self._land(op_ids)
        else:
            self._waits.put((op_ids, event))

    def poll(self) -> CacheResults:
        with self._lock:
            if self._error is not None:
                raise RuntimeError("waiting for a cache copy failed") from self._error
            acks, self._acks = self._acks, []
            return CacheResults(acks, self._landed)

    def _land(self, op_ids: list[int]) -> None:
        with self._lock:
            for op_id in op_ids:
                self._landed += 1
                if self._fault is None:
                    self._acks.append(op_id)
                else:
                    self._acks += self._fault.acks(op_id, self._landed)

    def _wait_main(self) -> None:
        while (item := self._waits.get()) is not None:
            op_ids, event = item
            try:
                event.synchronize()
            except BaseException as err:  # surfaces at the next poll
                logger.exception("cache ops %s failed", op_ids)
                with self._lock:
                    self._error = err
                return
            self._land(op_ids)

    def close(self) -> None:
        if self._thread is not None:
            self._waits.put(None)
            self._thread.join(timeout=10)
