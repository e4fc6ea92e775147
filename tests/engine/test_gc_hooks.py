"""The rank's garbage-collection policy: no automatic full collections, rare young ones,
full collections at rank-identical forward counts."""

import gc

import pytest

from tokenspeed_aio.data_plane.gc_hooks import GcHooks
from tokenspeed_aio.gc_policy import YOUNG_THRESHOLD, freeze_startup_heap


@pytest.fixture
def restore_gc():
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_freeze_startup_heap_freezes_survivors_and_raises_thresholds(restore_gc):
    keep = [[i] for i in range(1000)]  # tracked containers that survive the collection
    frozen = freeze_startup_heap(automatic_full_collections=False)
    assert frozen >= len(keep) and gc.get_freeze_count() == frozen
    young, _, old = gc.get_threshold()
    assert young == YOUNG_THRESHOLD
    assert old >= 10**9  # CPython never starts a full collection by itself


def test_the_frontend_keeps_cpythons_full_collections(restore_gc):
    _, _, old_before = gc.get_threshold()
    freeze_startup_heap(automatic_full_collections=True)
    young, _, old = gc.get_threshold()
    assert young == YOUNG_THRESHOLD and old == old_before


def test_full_collection_every_interval_forwards(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    hooks = GcHooks(interval=3)
    for _ in range(7):
        hooks.forwarded()
    assert len(calls) == 2  # after the 3rd and the 6th forward
