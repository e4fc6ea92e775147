"""No full garbage collection while serving, except at rank-identical rounds.

A rank freezes its startup heap and stops CPython from starting full collections by
itself (``gc_policy.freeze_startup_heap``); ``GcHooks`` runs one on the forward thread
every ``interval`` forwarded rounds, a count that is the same on every rank, so that no
rank's pause stalls the others through the round's collectives.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)

FULL_COLLECTION_INTERVAL = 4096


class GcHooks:
    def __init__(self, interval: int = FULL_COLLECTION_INTERVAL) -> None:
        self.interval = interval
        self.forwards = 0

    def forwarded(self) -> None:
        self.forwards += 1
        if self.forwards % self.interval == 0:
            start = time.perf_counter()
            gc.collect()
            logger.debug(
                "full gc on the forward thread: %.1f ms", 1e3 * (time.perf_counter() - start)
            )
