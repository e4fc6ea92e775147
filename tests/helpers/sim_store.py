"""A model-free L3 store and executor, for round tests of the storage tier: objects are
sim host pages (token ids), one ``SimStore`` shared by every engine (and rank) that uses
it, as engines share a Mooncake store. ``SimStorage`` is one rank's executor over its sim
host device: each op completes a random number of polls late (at most ``delay``), fails
with probability ``fail`` (as a store that errs or times out), and is reported exactly
once -- a GET writes its pages only when it completes, so a scheduler that hands its
blocks to someone else before the result would produce wrong tokens."""

from __future__ import annotations

import random

from helpers.sim_host import SimHostDevice
from tokenspeed_aio.control.storage import StorageReport, StorageResult
from tokenspeed_aio.scheduler.cache_ops import CancelOp, GetOp, PutOp, QueryOp


class SimStore:
    def __init__(self) -> None:
        self.objects: dict[int, tuple[tuple, list]] = {}  # hash -> (key, page)


class SimStorage:
    def __init__(
        self, store: SimStore, device: SimHostDevice, *, delay: int = 0, fail: float = 0.0,
        seed: int = 0,
    ) -> None:  # fmt: skip
        self.store = store
        self.device = device
        self.delay = delay
        self.fail = fail
        self.rng = random.Random(seed)
        self._open: dict[int, list] = {}  # op id -> [polls left, op]
        self.executed: dict[str, int] = {}
        self.extra: list[StorageResult] = []  # a test's forged results (an invalid report)
        self.up = True  # False: this rank reports its store down (a test sets it)

    def submit(self, ops) -> None:
        for op in ops:
            if isinstance(op, CancelOp):
                entry = self._open.get(op.op_id)
                if entry is not None:
                    entry[0] = -1  # completes as cancelled at the next poll
                continue
            self._open[op.op_id] = [self.rng.randint(0, self.delay), op]

    def poll(self) -> StorageReport:
        done = []
        for op_id, entry in list(self._open.items()):
            left, op = entry
            if left > 0:
                entry[0] -= 1
                continue
            del self._open[op_id]
            if left < 0:
                done.append(StorageResult(op_id, False, 0, "cancelled"))
            elif self.rng.random() < self.fail:
                done.append(StorageResult(op_id, False, 0, "timed out"))
            else:
                done.append(self._run(op))
        done += self.extra
        self.extra = []
        return StorageReport(0.0, len(self._open), done, self.up)

    def _run(self, op) -> StorageResult:
        self.executed[op.kind] = self.executed.get(op.kind, 0) + 1
        objects, host = self.store.objects, self.device.host
        if isinstance(op, QueryOp):
            n = 0
            while n < len(op.keys) and objects.get(op.keys[n][0], (None,))[0] == op.keys[n]:
                n += 1
            return StorageResult(op.op_id, True, n)
        if isinstance(op, GetOp):
            for key, block in zip(op.keys, op.host_blocks):
                found = objects.get(key[0])
                if found is None or found[0] != key:
                    return StorageResult(op.op_id, False, 0, "object missing")
                host[block] = list(found[1])
            return StorageResult(op.op_id, True, len(op.keys))
        assert isinstance(op, PutOp)
        for key, block in zip(op.keys, op.host_blocks):
            assert host[block] is not None, f"PUT of an unwritten host block: {op}"
            objects[key[0]] = (key, list(host[block]))
        return StorageResult(op.op_id, True, len(op.keys))
