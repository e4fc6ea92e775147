"""The engine's processes' garbage-collection settings, applied once startup is done.

Startup leaves millions of long-lived objects (modules, the tokenizer, the model's Python
side); a CPython full collection walks them all in hundreds of milliseconds.
``freeze_startup_heap`` collects once and freezes the survivors, so that no collection
walks them again, and raises the young generation's threshold: at CPython's 700
allocations a round with hundreds of running requests triggered several young
collections (0.3-1.2 ms each, in the round's tail latency), and a fan-out of thousands of
sequences one every few dozen sequences; at ``YOUNG_THRESHOLD`` they are rare and most
objects are gone before one runs (docs/performance.md, "Defaults chosen by measurement").

A rank also stops CPython from starting full collections by itself: it runs them at
rank-identical rounds (``data_plane/gc_hooks.py``), since one rank's pause stalls every
rank through the round's collectives. The frontend keeps CPython's full collections.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000
NEVER = 1_000_000_000


def freeze_startup_heap(*, automatic_full_collections: bool) -> int:
    """Collect, freeze the survivors, raise the young threshold; without
    ``automatic_full_collections`` CPython never starts a full collection. Returns the
    number of objects frozen."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old if automatic_full_collections else NEVER)
    return gc.get_freeze_count()
