"""The storage backends and the L3 executor against real stores: a directory, and a
``mooncake_master`` on loopback."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from tokenspeed_aio.cache.l3.backends import (
    FileBackend,
    MooncakeBackend,
    MooncakeSettings,
    StorageError,
)
from tokenspeed_aio.cache.l3.executor import RETRY_SECONDS, L3Executor
from tokenspeed_aio.cache.l3.identity import (
    DeploymentIdentity,
    decode_object,
    encode_object,
    object_key,
)
from tokenspeed_aio.scheduler.cache_ops import CancelOp, GetOp, PutOp, QueryOp
from tokenspeed_aio.scheduler.prefix_cache import chain_hash

PAGE = 4


def keys_of(tokens: list[int]) -> list[tuple]:
    out, parent = [], None
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        block = tuple(tokens[i : i + PAGE])
        h = chain_hash(parent, block)
        out.append((h, parent, block))
        parent = h
    return out


def mooncake(master) -> MooncakeBackend:
    return MooncakeBackend(MooncakeSettings(master.address, master.metadata_server, 32 * 2**20))


def wait_results(executor: L3Executor, n: int, timeout: float = 10.0) -> dict:
    got = {}
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {got} of {n} completed"
        for r in executor.poll().results:
            assert r.op_id not in got, "reported twice"
            got[r.op_id] = r
        time.sleep(0.005)
    return got


def test_identity_namespaces_differ_by_every_field():
    base = dict(architecture="LlamaForCausalLM", weights="w", dtype="bfloat16", page_size=16)
    a = DeploymentIdentity(**base, layout="[2,4,16,2,64] tp0/2")
    assert a.namespace == DeploymentIdentity(**base, layout="[2,4,16,2,64] tp0/2").namespace
    others = [
        DeploymentIdentity(**base, layout="[2,4,16,2,64] tp1/2"),
        DeploymentIdentity(**{**base, "weights": "w2"}, layout=a.layout),
        DeploymentIdentity(**{**base, "dtype": "float32"}, layout=a.layout),
        DeploymentIdentity(**{**base, "page_size": 32}, layout=a.layout),
        DeploymentIdentity(**{**base, "architecture": "Qwen2ForCausalLM"}, layout=a.layout),
    ]
    assert len({a.namespace, *(o.namespace for o in others)}) == 6


def test_object_header_refuses_another_block():
    (k1, k2) = keys_of(list(range(8)))
    page = memoryview(bytes(range(32)))
    value = encode_object(*k1, page)
    assert bytes(decode_object(value, *k1, 32)) == bytes(page)
    with pytest.raises(ValueError, match="another block"):
        decode_object(value, *k2, 32)
    with pytest.raises(ValueError, match="bytes"):
        decode_object(value[:-1], *k1, 32)
    forged = (k1[0], k1[1], (9, 9, 9, 9))  # same hash, other tokens: a collision
    with pytest.raises(ValueError, match="other tokens"):
        decode_object(value, *forged, 32)


def test_file_backend_roundtrip_and_namespace_delete(tmp_path):
    store = FileBackend(tmp_path)
    store.put_many(["ns1/a", "ns2/a"], [b"one", b"two"])
    assert store.exists(["ns1/a", "ns1/b"]) == [True, False]
    assert store.get_many(["ns1/a", "ns1/b"]) == [b"one", None]
    store.delete_namespace("ns1")
    assert store.exists(["ns1/a", "ns2/a"]) == [False, True]


def test_file_backend_crash_mid_write_leaves_no_readable_object(tmp_path, monkeypatch):
    store = FileBackend(tmp_path)
    store.put_many(["ns/a"], [b"old"])

    def crash(*_args):
        raise OSError("killed mid-write")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(StorageError, match="killed mid-write"):
        store.put_many(["ns/b"], [b"new"])
    with pytest.raises(StorageError):
        store.put_many(["ns/a"], [b"newer"])
    monkeypatch.undo()
    assert store.get_many(["ns/b", "ns/a"]) == [None, b"old"]  # never half there; old whole
    assert sorted(p.name for p in (tmp_path / "ns").iterdir()) == ["a"]  # no temporaries


def test_file_backend_refuses_an_unusable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="--kvstore-storage-dir"):
        FileBackend(blocker / "sub")


@pytest.mark.timeout(60)
def test_mooncake_backend_roundtrip_and_namespace_delete(mooncake_master):
    store = mooncake(mooncake_master)
    try:
        store.put_many(["nsA/x", "nsB/x"], [b"a" * 1000, b"b" * 10])
        assert store.exists(["nsA/x", "nsA/y"]) == [True, False]
        assert store.get_many(["nsA/x", "nsA/y"]) == [b"a" * 1000, None]
        store.delete_namespace("nsA")
        assert store.exists(["nsA/x", "nsB/x"]) == [False, True]
    finally:
        store.close()


@pytest.mark.parametrize("backend", ["file", "mooncake"])
@pytest.mark.timeout(60)
def test_executor_put_query_get(backend, tmp_path, request):
    store = (
        FileBackend(tmp_path)
        if backend == "file"
        else mooncake(request.getfixturevalue("mooncake_master"))
    )
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 255, (8, 64), dtype=np.uint8)
    ex = L3Executor(store, pages, f"ns-{backend}", timeout=5.0)
    try:
        keys = tuple(keys_of(list(range(12))))  # 3 blocks
        ex.submit([PutOp(1, keys[:2], (0, 1))])
        assert wait_results(ex, 1)[1].ok
        ex.submit([QueryOp(2, "r", keys)])
        query = wait_results(ex, 1)[2]
        assert query.ok and query.value == 2  # the leading run found
        ex.submit([GetOp(3, "r", keys[:2], (5, 6))])
        get = wait_results(ex, 1)[3]
        assert get.ok and get.value == 2 * 64
        assert (pages[5] == pages[0]).all() and (pages[6] == pages[1]).all()
        ex.submit([GetOp(4, "r", keys[1:], (7, 7))])  # the third is missing
        missing = wait_results(ex, 1)[4]
        assert not missing.ok and missing.error == "object missing"
        ex.delete_namespace()
        ex.submit([QueryOp(5, "r", keys)])
        assert wait_results(ex, 1)[5].value == 0
    finally:
        ex.close()


class SlowStore(FileBackend):
    """A directory whose reads hang until released: a store that stopped answering."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.release = threading.Event()

    def get_many(self, keys):
        self.release.wait(20)
        return super().get_many(keys)


@pytest.mark.timeout(60)
def test_executor_timeout_and_cancel_never_write_pages_late(tmp_path):
    store = SlowStore(tmp_path)
    pages = np.zeros((4, 16), np.uint8)
    ex = L3Executor(store, pages, "ns", timeout=0.2, workers=2)
    try:
        (key,) = keys_of([1, 2, 3, 4])
        value = encode_object(*key, memoryview(b"\x07" * 16))
        store.put_many([f"ns/{key[0] & (2**64 - 1):016x}"], [value])
        ex.submit([GetOp(1, "a", (key,), (0,)), GetOp(2, "b", (key,), (1,))])
        ex.submit([CancelOp(2)])
        got = wait_results(ex, 2)
        assert got[2].error == "cancelled"
        assert got[1].error == "timed out" and got[1].seconds >= 0.2
        # the store hangs: marked down, what comes next fails at once (the worker is
        # still stuck), until the prober's lookup answers
        ex.submit([GetOp(3, "c", (key,), (2,))])
        late = wait_results(ex, 1)[3]
        assert late.error == "store unavailable" and late.seconds < 0.1
        store.release.set()  # the workers come back from the store now
        time.sleep(0.3)
        assert not pages.any(), "a late GET wrote into pages given away"
        assert ex.poll().results == [] and ex.poll().queue_depth == 0
    finally:
        store.release.set()
        ex.close()


class GoneStore(FileBackend):
    """A directory that refuses every call while ``gone`` is set (a store that went away),
    recording the keys of each call it refused."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.gone = threading.Event()
        self.refused: list[list[str]] = []

    def _check(self, keys) -> None:
        if self.gone.is_set():
            self.refused.append(list(keys))
            raise StorageError("file store: gone")

    def exists(self, keys):
        self._check(keys)
        return super().exists(keys)

    def get_many(self, keys):
        self._check(keys)
        return super().get_many(keys)

    def put_many(self, keys, values):
        self._check(keys)
        super().put_many(keys, values)


def wait_up(executor: L3Executor, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not executor.poll().store_up:
        assert time.monotonic() < deadline, f"the store was not marked up in {timeout} s"
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_store_marked_down_fails_ops_at_once_and_only_the_prober_asks_it(tmp_path):
    store = GoneStore(tmp_path)
    pages = np.zeros((4, 16), np.uint8)
    ex = L3Executor(store, pages, "ns", timeout=5.0)
    try:
        keys = tuple(keys_of(list(range(8))))
        store.gone.set()
        ex.submit([QueryOp(1, "a", keys)])
        first = wait_results(ex, 1)[1]
        assert not first.ok and "gone" in first.error
        assert not ex.poll().store_up
        ex.submit([QueryOp(i, "r", keys) for i in range(2, 12)] + [PutOp(12, keys[:1], (0,))])
        got = wait_results(ex, 11)  # no worker waits on the store: all at once
        assert all(r.error == "store unavailable" and r.seconds < 0.1 for r in got.values())
        time.sleep(2.5 * RETRY_SECONDS)
        probes = store.refused[1:]  # after the query's call, only the prober's, one by one
        assert store.refused[0] == [object_key("ns", k[0]) for k in keys]
        assert 1 <= len(probes) <= 3 and all(p == ["ns/probe"] for p in probes), probes
        store.gone.clear()
        wait_up(ex, 3 * RETRY_SECONDS)
        ex.submit([PutOp(13, keys, (0, 1))])
        assert wait_results(ex, 1)[13].ok
        ex.submit([QueryOp(14, "a", keys)])
        assert wait_results(ex, 1)[14].value == 2  # the store is used again
    finally:
        ex.close()


@pytest.mark.timeout(120)
def test_executor_on_a_killed_master_fails_at_once_then_uses_the_new_one(mooncake_master):
    """A real master SIGKILLed: the op in flight ends within the timeout, every later one
    at once; a master started again on the same ports is found by the prober and used."""
    store = mooncake(mooncake_master)
    pages = np.random.default_rng(1).integers(0, 255, (8, 64), dtype=np.uint8)
    ex = L3Executor(store, pages, "ns-kill", timeout=2.0)
    keys = tuple(keys_of(list(range(8))))
    try:
        ex.submit([PutOp(1, keys, (0, 1))])
        assert wait_results(ex, 1)[1].ok
        mooncake_master.kill()
        ex.submit([QueryOp(2, "r", keys)])
        gone = wait_results(ex, 1, timeout=2.0 + 1.0)[2]  # failed, or timed out
        assert not gone.ok and gone.seconds <= 2.0 + 0.5, gone
        for batch in (range(3, 13), range(13, 23)):  # the second past the first probe
            ex.submit([QueryOp(i, "r", keys) for i in batch])
            got = wait_results(ex, 10, timeout=0.5)
            assert all(r.error == "store unavailable" for r in got.values()), got
            time.sleep(1.5 * RETRY_SECONDS)
        mooncake_master.start()
        deadline = time.monotonic() + 60
        for op_id in range(23, 1000):  # the new master holds nothing: published again
            wait_up(ex, deadline - time.monotonic())
            ex.submit([PutOp(op_id, keys, (0, 1))])
            # until the client remounted its segment the new master has no space for it
            if wait_results(ex, 1, timeout=10)[op_id].ok:
                break
        ex.submit([GetOp(1000, "r", keys, (4, 5))])
        assert wait_results(ex, 1, timeout=10)[1000].ok
        assert (pages[4] == pages[0]).all() and (pages[5] == pages[1]).all()
    finally:
        ex.close()
        if mooncake_master.proc is None:
            mooncake_master.start()
