"""DeviceHandle: the complete list of what the control plane may ask of the device side,
as named operations, and the order in which a plan's device work is submitted (``execute``).
build_device_side (device.py) constructs it around the runner, the KV pools and the cache
executors it built as its own locals; the handle holds them privately, so the control plane
cannot pass one along or change one a forward uses.
"""

from __future__ import annotations

import torch

from tokenspeed_aio.cache.executor import HostCacheExecutor
from tokenspeed_aio.cache.l3.executor import L3Executor
from tokenspeed_aio.cache.ops import NO_CACHE_OPS, DeviceCacheOps
from tokenspeed_aio.control.cache_ops import CacheResults
from tokenspeed_aio.data_plane.landing import LaunchedForward, no_forward
from tokenspeed_aio.data_plane.memory_saver import MemorySaver
from tokenspeed_aio.data_plane.profiler import ForwardProfiler
from tokenspeed_aio.data_plane.runner import ModelRunner
from tokenspeed_aio.data_plane.weight_updates import WeightUpdater
from tokenspeed_aio.guards.compile_monitor import compile_monitor
from tokenspeed_aio.guards.host_sync import arm_sync_debug
from tokenspeed_aio.pd.peer import PeerLoop
from tokenspeed_aio.scheduler.plan import ExecutionPlan
from tokenspeed_aio.wire.control import InitWeightsGroup, StartProfile


class DeviceHandle:
    """What the running loop may ask of the device: named operations, nothing else."""

    def __init__(
        self,
        runner: ModelRunner,
        device: torch.device,
        *,
        memory: MemorySaver,
        weights: WeightUpdater,
        profiler: ForwardProfiler,
        cache: HostCacheExecutor,
        transfer: PeerLoop | None = None,
        storage: L3Executor | None = None,
    ) -> None:
        self._runner = runner
        self._device = device
        self._memory = memory
        self._weights = weights
        self._profiler = profiler
        self._cache = cache
        self._transfer = transfer  # the PD transfer peer, the plans' second executor
        # The L3 executor (host worker threads): the control thread submits to it and polls
        # it itself, through the data plane; no device work goes through it.
        self.storage = storage

    def enter_serving(self) -> None:
        """Startup is over: arm the sync-debug mode, then close the JIT window."""
        arm_sync_debug(self._device)
        compile_monitor().mark_serving()

    @torch.inference_mode()
    def execute(
        self, plan: ExecutionPlan, cache_ops: DeviceCacheOps = NO_CACHE_OPS
    ) -> LaunchedForward:
        """Submit the plan, in an order that is itself a correctness contract for pages and
        slots this very plan re-grants (the scheduler frees and hands them out while it
        builds the plan):

        1. host-bound stores: the stream-ordered ones (a retraction image's write-back and
           snapshot store, write_back's evictions) read pages and slots the plan may
           re-grant, so they ride the write stream consecutively and ONE event fences the
           forward stream before anything below is enqueued; the write-through stores
           (sources pinned by the scheduler) follow on the write stream, fencing nothing;
        2. device-to-device block copies (``pages_to_copy``), on the forward stream: a
           source may be re-granted and zeroed by this plan, so they precede the zeroing;
        3. page zeroing (``pages_to_zero``), a new owner's sanitization;
        4. device-bound loads on the load stream, behind all of the above: load-backs
           (onto fresh pages; the batch reads them behind per-layer fences), then
           restores (whole blocks and the new slot's state; no fence, their requests are
           unschedulable until the ACK);
        5. the batch; after it the forward stream waits for the whole load, so later plans
           read the loaded pages too;
        6. the remote streams to the transfer peer: landing pages are advertised only
           behind a fence on every forward queued before them (the prefill ranks' writes
           are not ordered with the device); a finished prompt's KV is complete already
           (its result landed before it was planned).
        """
        cache = self._cache
        if cache_ops.ordered_stores or cache_ops.stores:
            cache.store(cache_ops)
        if plan.pages_to_copy:
            cache.copy_blocks(plan.pages_to_copy)
        if plan.pages_to_zero:
            cache.zero_blocks(plan.pages_to_zero)
        fences = cache.load(cache_ops) if cache_ops.loads or cache_ops.restores else None
        if plan.rows:
            launched = self._runner.execute(plan, fences)
            self._profiler.step()
        else:
            stats = compile_monitor().stats
            launched = no_forward(plan, (stats.serving_compiles, stats.serving_compile_seconds))
        cache.joined(fences)
        if plan.remote_prefill:
            self._transfer.stage(plan.remote_prefill, self._fence())
        if plan.remote_decode:
            self._transfer.stage(plan.remote_decode, None)
        return launched

    def poll_cache_results(self) -> CacheResults:
        """Completion query (the control thread calls it itself): the cache ops landed since
        the last call. Reads what the completion thread recorded; touches no stream."""
        return self._cache.poll()

    def _fence(self):
        """A wait for everything queued on the device so far (None on CPU, where the
        forward thread ran it all already)."""
        if self._device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event.synchronize

    def idle_forward(self) -> None:
        self._runner.idle_forward()

    def forward_timeline(self) -> dict[str, float] | None:
        """Profiling: device busy/idle time over the forwards since the last call."""
        return self._runner.timeline.summary()

    # -- control operations (low rate; the loop awaits each) --------------------------------
    def release_memory(self, tags: list[str]) -> None:
        self._memory.release(tags)

    def resume_memory(self, tags: list[str]) -> None:
        self._memory.resume(tags)

    def stage_weights(self, update: object) -> str | None:
        if "weights" in self._memory.released:
            return "the weights are released: resume them before updating them"
        return self._weights.stage(update)

    def load_staged_weights(self) -> str | None:
        return self._weights.load()

    def commit_weights(self, ok: bool | None) -> None:
        self._weights.commit(ok)

    def init_weights_group(self, op: InitWeightsGroup) -> None:
        self._weights.init_group(op)

    def destroy_weights_group(self, group_name: str) -> None:
        self._weights.destroy_group(group_name)

    def start_profile(self, op: StartProfile) -> None:
        self._profiler.start(op)

    def stop_profile(self) -> str:
        return self._profiler.stop()

    def shutdown(self) -> None:
        self._memory.close()
        compile_monitor().end_serving()
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None
        self._runner = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if self._device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)  # the process may go on without the engine
            torch.cuda.synchronize(self._device)
        if self.storage is not None:  # before the pages it reads go
            self.storage.close()
            self.storage = None
        self._cache.close()  # after the device finished every copy
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
