"""Paged KV blocks: reference counts, a reserved null block, and the prefix-cache index.

Every block but block 0 is either *active* (referenced by at least one request) or
*free*. Free blocks wait in one LRU queue (free_queue.py); a free block may still hold a
cached prefix (it has a hash), in which case it is reusable by a prefix hit until a new
allocation evicts it. Uncached blocks enter the queue at its front so they are handed out
before any cached block is evicted.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenspeed_aio.scheduler.free_queue import FreeQueue
from tokenspeed_aio.scheduler.kv_events import KVEventLog

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash: list[int | None] = [None] * num_blocks
        self._cached_key: list[tuple[int | None, tuple[int, ...]] | None] = [None] * num_blocks
        self._free = FreeQueue(num_blocks, first=1, what="block")
        self._num_empty = num_blocks - 1  # free and holding no cached prefix
        self._cache: dict[int, int] = {}  # block hash -> block id
        self.events = KVEventLog()
        # The host tier's feeds (None while it is off): blocks published since it last
        # took them (write_through), and (block, key) of blocks evicted (write_back).
        self.published: list[int] | None = None
        self.evicted: list[tuple[int, tuple[int, int | None, tuple[int, ...]]]] | None = None

    # -- sizes --------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (empty ones plus evictable cached ones)."""
        return len(self._free)

    @property
    def num_active(self) -> int:
        return self._free.num_active

    @property
    def num_resident(self) -> int:
        """Blocks holding data: active plus cached-only."""
        return self.num_usable - self._num_empty

    def ref_count(self, block: int) -> int:
        return self._free.ref_count(block)

    # -- allocation ---------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        blocks = self._free.allocate(n)
        for block in blocks:
            key = self._hash[block]
            if key is None:
                self._num_empty -= 1
            else:
                self._evict(block, key)
        return blocks

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on prefix-cache hits (which may sit in the free queue)."""
        self._free.ref(blocks)

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; tail blocks first, so they are evicted first."""
        for block in reversed(blocks):
            if not self._free.unref(block):
                continue
            if self._hash[block] is None:
                self._free.push_empty(block)
                self._num_empty += 1
            else:
                self._free.push_recent(block)

    # -- prefix cache -------------------------------------------------------
    def lookup(self, keys: Sequence[tuple[int, int | None, tuple[int, ...]]]) -> list[int]:
        """Longest cached prefix for (hash, parent hash, tokens) of a request's full blocks."""
        hits = []
        for key, parent, tokens in keys:
            block = self._cache.get(key)
            if block is None or self._cached_key[block] != (parent, tokens):
                break
            hits.append(block)
        return hits

    def num_evictable_among(self, blocks: Sequence[int]) -> int:
        """How many of these (hit) blocks currently sit in the free queue."""
        return sum(1 for b in blocks if self._free.ref_count(b) == 0)

    def cache(self, block: int, key: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        """Publish an active, fully written block under its chain hash."""
        if key in self._cache or self._hash[block] is not None:
            return  # the same content is cached in another block already
        self._cache[key] = block
        self._hash[block] = key
        self._cached_key[block] = (parent, tokens)
        self.events.stored(key, parent, tokens)
        if self.published is not None:
            self.published.append(block)

    def key_of(self, block: int) -> tuple[int, int | None, tuple[int, ...]] | None:
        """(hash, parent hash, tokens) of a cached block, or None."""
        key = self._hash[block]
        if key is None:
            return None
        parent, tokens = self._cached_key[block]
        return key, parent, tokens

    def _evict(self, block: int, key: int) -> None:
        if self.evicted is not None:
            self.evicted.append((block, (key, *self._cached_key[block])))
        del self._cache[key]
        self._hash[block] = None
        self._cached_key[block] = None
        self.events.removed(key)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached-only block's hash; refused (False) while any block is active."""
        if self._free.num_active:
            return False
        for block in self._free:
            key = self._hash[block]
            if key is not None:
                del self._cache[key]
                self._hash[block] = None
                self._cached_key[block] = None
                self._num_empty += 1
        self.events.cleared()
        return True

    def cached_hashes(self) -> set[int]:
        return set(self._cache)

    def check_idle(self) -> None:
        """Leak check: with no request resident, every block is free and unreferenced."""
        active = [b for b in self._free.referenced() if b != NULL_BLOCK]
        if active or self._free.num_active or len(self._free) != self.num_usable:
            raise AssertionError(
                f"block leak: active={active[:16]} num_active={self._free.num_active} "
                f"free={len(self._free)}/{self.num_usable}"
            )
        if self._free.ref_count(NULL_BLOCK) or NULL_BLOCK in self._free:
            raise AssertionError("null block was handed out")
