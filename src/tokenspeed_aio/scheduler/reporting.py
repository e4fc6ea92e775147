"""What the scheduler holds, as the loop and the control operations read it: the prefix
cache's control (can a flush run, the reset across tiers), the KV events and the load
report, the work queries and the leak check.

``Scheduler`` (scheduler.py) takes these methods; they read its state, and the reset
changes the tiers' caches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from tokenspeed_aio.scheduler.state import SchedulerState
from tokenspeed_aio.wire.messages import CacheLoad, Load

if TYPE_CHECKING:
    from tokenspeed_aio.scheduler.kv_events import KVEvent


class ReportingMixin(SchedulerState):
    # -- the prefix cache, as control operations see it ------------------------------
    def can_clear_cache(self) -> bool:
        """Whether a flush may run now (non-mutating): no request holds a KV block, and
        with the host tier no cache op is open and no retraction image is held."""
        tier = self.host_tier
        return (
            self.pool.num_active == 0
            and (tier is None or tier.idle())
            and (self.storage is None or not self.storage.has_work())
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix, in both tiers (one AllBlocksCleared event); False while
        blocks are held."""
        if not self.can_clear_cache():
            return False
        if self.host_tier is not None:
            self.host_tier.host.clear()
        if self.storage is not None:  # the flush deleted the store's objects too
            self.storage.forget()
        return self.pool.reset_prefix_cache()

    def cached_block_hashes(self) -> set[int]:
        """The prefix cache's keys (diagnostics and tests: what KV-event subscribers rebuild)."""
        return self.pool.cached_hashes()

    # -- reporting --------------------------------------------------------------
    def drain_kv_events(self) -> list[KVEvent]:
        return self.pool.events.drain()

    def load(self) -> Load:
        tier = self.host_tier
        cache = None
        if tier is not None:
            host = tier.host
            cache = CacheLoad(
                host_total_blocks=host.num_blocks,
                host_resident_blocks=host.num_resident,
                host_active_blocks=host.num_active,
                l2_hit_tokens=tier.stats.l2_hit_tokens,
                images=tier.stats.images,
                restores=tier.stats.restores,
            )
        if self.storage is not None:
            st = self.storage.stats
            cache = msgspec.structs.replace(
                cache,
                l3_queries=st.queries,
                l3_query_hit_tokens=st.query_hit_tokens,
                l3_fetched_tokens=st.fetched_tokens,
                l3_recomputed_tokens=st.recomputed_tokens,
                l3_preparing=len(self.storage.preparing),
            )
        return Load(
            running=len(self.running),
            waiting=len(self.waiting),
            resident_blocks=self.pool.num_resident,
            active_blocks=self.pool.num_active,
            total_blocks=self.pool.num_usable,
            forward_rounds=self.forward_rounds,
            forward_tokens=self.forward_tokens,
            num_preemptions=self.num_retractions,
            cache=cache,
        )

    def has_work(self) -> bool:
        """Anything to plan: a request to run, a forward to commit, a transfer, a cache op
        to land or a write-back to plan."""
        tier = self.host_tier
        return bool(
            self.running
            or self.waiting
            or self._inflight
            or self._transfers_pending()
            or (tier is not None and tier.has_work())
            or (self.storage is not None and self.storage.has_work())
        )

    def has_cache_work(self) -> bool:
        """A host-tier cache op to land or a write-back to plan, or a storage op open."""
        tier, storage = self.host_tier, self.storage
        return (tier is not None and tier.has_work()) or (
            storage is not None and storage.has_work()
        )

    def check_idle(self) -> None:
        """Leak check: no request, slot, block or in-flight forward is held."""
        if self.requests or self.running or self.waiting or self._inflight:
            raise AssertionError(
                f"scheduler still holds requests={list(self.requests)[:8]} "
                f"running={len(self.running)} waiting={len(self.waiting)} "
                f"inflight={list(self._inflight)}"
            )
        if len(self._free_slots) != self.config.max_num_seqs:
            raise AssertionError(f"slot leak: {len(self._free_slots)} free slots")
        if self.storage is not None:
            self.storage.check_idle()
        if self.host_tier is not None:
            self.host_tier.check_idle()
        self.pool.check_idle()
