"""HostCacheExecutor: the data plane's half of the host tiers, one per rank, behind the
DeviceHandle. It runs a plan's cache ops in the steps DeviceHandle.execute orders, on two
streams of its own besides the forward's (the default stream):

    write stream:  host-bound stores (write-backs, snapshot stores)
    load stream:   device-bound loads (load-backs, restores)

and reports when each op landed (completions.py). On CPU there are no streams: each step's
copies run when it is submitted, in the same order, so the order itself is what tests see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from tokenspeed_aio.cache.completions import Completions
from tokenspeed_aio.cache.copies import BlockCopier
from tokenspeed_aio.cache.fences import LayerFences
from tokenspeed_aio.cache.host_pool import release_host_pages
from tokenspeed_aio.cache.ops import DeviceCacheOps
from tokenspeed_aio.cache.snapshot_pool import SlotStates
from tokenspeed_aio.control.cache_ops import CacheResults
from tokenspeed_aio.control.faults import CacheAckFault
from tokenspeed_aio.model.sampling.state import SamplingState
from tokenspeed_aio.scheduler.cache_ops import LoadBackOp, SnapshotOp

STAGE_BYTES = 64 * 2**20  # each stream's staging buffer (at least one block)


class HostCacheExecutor:
    def __init__(
        self,
        pool: Callable[[], torch.Tensor],
        *,
        host_pages: torch.Tensor | None,
        snapshot_pages: torch.Tensor | None,
        slot_states: SlotStates | None,
        sampling: SamplingState,
        last_sampled: torch.Tensor,
    ) -> None:
        kv = pool()  # the device KV pool [2, L, N, page, H, D], as it is now
        self.pool = pool
        self.device = kv.device
        self.host_pages = host_pages
        self.snapshot_pages = snapshot_pages
        self.slot_states = slot_states
        self.sampling = sampling
        self.last_sampled = last_sampled
        self.cuda = kv.device.type == "cuda"
        block_bytes = kv[:, :, 0].numel() * kv.element_size()
        stage = max(1, STAGE_BYTES // block_bytes)
        self.device_copier = BlockCopier(pool, 0)  # pages_to_copy / pages_to_zero
        if host_pages is not None:
            self.store_copier = BlockCopier(pool, stage)
            self.load_copier = BlockCopier(pool, stage)
        self.write_stream = torch.cuda.Stream(kv.device) if self.cuda else None
        self.load_stream = torch.cuda.Stream(kv.device) if self.cuda else None
        self.completions = Completions(self.cuda, CacheAckFault.from_env())

    # -- the steps of DeviceHandle.execute -------------------------------------------
    def store(self, ops: DeviceCacheOps) -> None:
        """Host-bound stores. The stream-ordered ones ride the write stream consecutively,
        behind everything the forward stream holds so far (they read what it wrote), and
        ONE event after them fences the forward stream before anything else of the plan is
        enqueued; the pinned-source ones follow on the write stream and fence nothing."""
        forward = torch.cuda.current_stream(self.device) if self.cuda else None
        fence = None
        with self._on(self.write_stream):
            if forward is not None:
                self.write_stream.wait_stream(forward)
            if ops.ordered_stores:
                for op in ops.ordered_stores:
                    self._store_one(op)
                fence = self._event()
                self.completions.submitted([op.op_id for op in ops.ordered_stores], fence)
            for op in ops.stores:
                self._store_one(op)
                self.completions.submitted([op.op_id], self._event())
        if fence is not None:
            forward.wait_event(fence)

    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """The plan's device-to-device block copies, on the forward stream."""
        self.device_copier.copy_blocks(pairs)

    def zero_blocks(self, blocks: tuple[int, ...]) -> None:
        """The plan's page zeroing (a new owner's sanitization), on the forward stream."""
        self.device_copier.zero_blocks(blocks)

    def load(self, ops: DeviceCacheOps) -> LayerFences | None:
        """Device-bound loads, on the load stream behind the forward stream (so behind the
        store fence, the copies and the zeroing): the load-backs first, with one event per
        layer (the fences the batch waits on, returned), then the restores, one event each
        (no fence: their requests are unschedulable until the ACK)."""
        fences = None
        forward = torch.cuda.current_stream(self.device) if self.cuda else None
        with self._on(self.load_stream):
            if forward is not None:
                self.load_stream.wait_stream(forward)
            if ops.loads:
                fences = self._load_backs(ops.loads)
            for op in ops.restores:
                sources = [(self.host_pages, b) for b in op.l2_blocks]
                sources += [(self.snapshot_pages, p) for p in op.snapshot_pages]
                self.load_copier.load(sources.__getitem__, len(sources), op.dst_blocks)
                self.slot_states.restore(op.state, op.slot, self.sampling, self.last_sampled)
                self.completions.submitted([op.op_id], self._event())
        return fences

    def joined(self, fences: LayerFences | None) -> None:
        """After the batch was enqueued: the forward stream waits for the whole load, so
        every later plan reads the loaded blocks whether or not this batch waited."""
        if fences is not None:
            fences.wait_all()

    def poll(self) -> CacheResults:
        return self.completions.poll()

    def close(self) -> None:
        """After the last op landed (the caller synchronized): stop the completion thread
        and hand the pinned pages back."""
        self.completions.close()
        release_host_pages(self.host_pages, self.cuda)
        release_host_pages(self.snapshot_pages, self.cuda)
        self.host_pages = self.snapshot_pages = None

    # -- helpers ------------------------------------------------------------------
    def _store_one(self, op) -> None:
        if isinstance(op, SnapshotOp):
            if op.src_blocks:
                self.store_copier.store(op.src_blocks, self.snapshot_pages, op.dst_pages)
            self.slot_states.export(op.state, op.slot, self.sampling, self.last_sampled)
        else:
            self.store_copier.store(op.src_blocks, self.host_pages, op.dst_blocks)

    def _load_backs(self, loads: tuple[LoadBackOp, ...]) -> LayerFences | None:
        src = [b for op in loads for b in op.src_blocks]
        dst = [b for op in loads for b in op.dst_blocks]
        events: list[torch.cuda.Event] = []
        per_layer = (lambda _layer: events.append(self._event())) if self.cuda else None
        self.load_copier.load(lambda i: (self.host_pages, src[i]), len(src), dst, per_layer)
        self.completions.submitted([op.op_id for op in loads], self._event())
        return LayerFences(events) if events else None

    def _event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield
