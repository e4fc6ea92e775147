"""A model-free device with host tiers, for scheduler tests of the L2 tier and retraction
images: host pages and snapshot pages hold token ids, like SimDevice's KV pages.

It runs a plan's cache ops the way the real data plane orders them, and delays the ones
the real data plane runs asynchronously, so a scheduler that reuses a page an open op
still reads or writes produces wrong tokens:

* stream-ordered stores (retraction images, write_back evictions) and load-backs run at
  dispatch, before the batch (the forward waits for them);
* write-through stores and restores run only when their ACK is delivered, ``ack_delay``
  rounds later (a copy that overlaps later forwards reads and writes then);
* every op is acknowledged exactly once, through ``poll``.
"""

from __future__ import annotations

import random

from helpers.sim_device import SimDevice
from tokenspeed_aio.scheduler.plan import ExecutionPlan, ForwardResult


class SimHostDevice(SimDevice):
    def __init__(
        self,
        num_blocks: int,
        page_size: int,
        num_slots: int,
        num_host_blocks: int,
        num_snapshot_pages: int,
        num_states: int,
        ack_delay: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(num_blocks, page_size, num_slots)
        self.host: list[list[int | None] | None] = [None] * num_host_blocks
        self.snapshot: list[list[int | None] | None] = [None] * num_snapshot_pages
        self.states: list[tuple | None] = [None] * num_states  # (future token, slot owner)
        self.ack_delay = ack_delay
        self.rng = random.Random(seed)
        self._deferred: list[tuple[int, list, object]] = []  # (rounds left, op ids, run)
        self._ready: list[int] = []
        self.executed: dict[str, int] = {}  # op kind -> ops run

    def _count(self, op) -> None:
        self.executed[op.kind] = self.executed.get(op.kind, 0) + 1

    def execute(self, plan: ExecutionPlan) -> ForwardResult:
        cache = plan.cache
        if cache is not None:
            for op in cache.write_backs:
                if op.stream_ordered:
                    self._write_back(op)
                    self._ready.append(op.op_id)
                else:
                    self._defer(op, self._write_back)
            for op in cache.snapshots:
                for src, dst in zip(op.src_blocks, op.dst_pages):
                    self.snapshot[dst] = list(self.kv[src])
                self.states[op.state] = (self.last_sampled[op.slot], self.owners[op.slot])
                self._count(op)
                self._ready.append(op.op_id)
            for op in cache.loads:
                for src, dst in zip(op.src_blocks, op.dst_blocks):
                    assert self.host[src] is not None, f"load of an unwritten host block: {op}"
                    self.kv[dst] = list(self.host[src])
                self._count(op)
                self._ready.append(op.op_id)
            for op in cache.restores:
                self._defer(op, self._restore)
        return super().execute(plan)

    def _write_back(self, op) -> None:
        for src, dst in zip(op.src_blocks, op.dst_blocks):
            self.host[dst] = list(self.kv[src])
        self._count(op)

    def _restore(self, op) -> None:
        srcs = [self.host[b] for b in op.l2_blocks] + [self.snapshot[p] for p in op.snapshot_pages]
        for src, dst in zip(srcs, op.dst_blocks):
            assert src is not None, f"restore from an unwritten page: {op}"
            self.kv[dst] = list(src)
        self.last_sampled[op.slot], self.owners[op.slot] = self.states[op.state]
        self._count(op)

    def _defer(self, op, run) -> None:
        delay = self.rng.randint(0, self.ack_delay)
        self._deferred.append((delay, op, run))

    def poll(self) -> list[int]:
        """The ops acknowledged since the last poll (deferred ones run now)."""
        still = []
        for left, op, run in self._deferred:
            if left <= 0:
                run(op)
                self._ready.append(op.op_id)
            else:
                still.append((left - 1, op, run))
        self._deferred = still
        ready, self._ready = self._ready, []
        return ready
