"""No full garbage collection while serving, except at rank-identical rounds.

Startup leaves millions of long-lived objects; a CPython full collection walks
them all in hundreds of milliseconds, stalling every thread of the rank (and,
through the round's collectives, every rank). ``freeze_startup_heap`` collects
once, freezes the survivors and raises the generation-2 threshold so CPython does
not start full collections by itself; ``GcHooks`` runs one on the forward thread
every ``interval`` forwarded rounds, a count that is the same on every rank.

The young generation's threshold is raised too: at CPython's 700 allocations a round with
hundreds of running requests triggered several young collections (0.3-1.2 ms each, in the
round's tail latency); at ``YOUNG_THRESHOLD`` they are rare and the objects a round makes
are mostly gone before one runs (docs/performance.md, "Garbage collection thresholds").
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)

FULL_COLLECTION_INTERVAL = 4096
YOUNG_THRESHOLD = 20_000
_NEVER = 1_000_000_000


def freeze_startup_heap() -> int:
    gc.collect()
    gc.freeze()
    _, gen1, _ = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, gen1, _NEVER)
    return gc.get_freeze_count()


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
