"""The L2 host KV pool as the scheduler owns it: block ids, reference counts, the index of
published blocks and LRU eviction of unreferenced ones. The bytes live in the data plane's
pinned buffer (cache/host_pool.py); every use of a block is decided here.

A host block is *referenced* while an open cache op writes or reads it, or a retraction
image holds it; otherwise it is *free*: empty, or holding a published block (evictable,
least recently used first). A block is published -- it enters the index and a ``CPU``
BlockStored event -- when the write-back that fills it is acknowledged; until then its key
is *pending*: no lookup hits it, and no second copy of it is written. Free blocks wait in
one LRU queue (free_queue.py), empty ones in front of published ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenspeed_aio.scheduler.free_queue import FreeQueue
from tokenspeed_aio.scheduler.kv_events import CPU, KVEventLog

BlockKey = tuple[int, int | None, tuple[int, ...]]  # (hash, parent hash, tokens)


class HostBlockPool:
    def __init__(self, num_blocks: int, events: KVEventLog) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.events = events
        self._key: list[BlockKey | None] = [None] * num_blocks  # published or pending
        self._landed = [False] * num_blocks  # its bytes were written (the write was ACKed)
        self._free = FreeQueue(num_blocks, first=0, what="host block")
        self._num_empty = num_blocks
        self._index: dict[int, int] = {}  # published hash -> block
        self._pending: dict[int, int] = {}  # hash being written -> block

    # -- sizes --------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (empty ones plus evictable published ones)."""
        return len(self._free)

    @property
    def num_active(self) -> int:
        return self._free.num_active

    @property
    def num_resident(self) -> int:
        """Blocks holding (or being written with) data."""
        return self.num_blocks - self._num_empty

    @property
    def num_published(self) -> int:
        return len(self._index)

    # -- allocation ---------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks for writes, referenced once each; evicts the least recently used."""
        blocks = self._free.allocate(n)
        for block in blocks:
            key = self._key[block]
            if key is None:
                self._num_empty -= 1
            else:  # a published block: evicted
                del self._index[key[0]]
                self._key[block] = None
                self.events.removed(key[0], CPU)
            self._landed[block] = False
        return blocks

    def ref(self, blocks: Iterable[int]) -> None:
        self._free.ref(blocks)

    def unref(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if not self._free.unref(block):
                continue
            key = self._key[block]
            if key is not None and self._index.get(key[0]) == block:
                self._free.push_recent(block)  # published: most recently used
                continue
            if key is not None:  # pending and never landed: its write was abandoned
                del self._pending[key[0]]
                self._key[block] = None
            self._landed[block] = False
            self._free.push_empty(block)
            self._num_empty += 1

    # -- the index ----------------------------------------------------------
    def reserve(self, block: int, key: BlockKey) -> None:
        """``block`` (just allocated) will hold ``key`` once its write-back lands."""
        self._key[block] = key
        self._pending[key[0]] = block

    def landed(self, blocks: Iterable[int]) -> None:
        """The write-back filling these blocks was acknowledged: publish their keys."""
        for block in blocks:
            self._landed[block] = True
            key = self._key[block]
            if key is not None and self._pending.get(key[0]) == block:
                del self._pending[key[0]]
                self._index[key[0]] = block
                self.events.stored(key[0], key[1], key[2], CPU)

    def ref_count(self, block: int) -> int:
        return self._free.ref_count(block)

    def published_key(self, block: int) -> BlockKey | None:
        """The key ``block`` holds, if it is published (landed and in the index)."""
        key = self._key[block]
        if key is None or self._index.get(key[0]) != block:
            return None
        return key

    def is_landed(self, block: int) -> bool:
        return self._landed[block]

    def find(self, key: BlockKey) -> int | None:
        """The block holding or being written with ``key`` (verified), or None."""
        block = self._index.get(key[0])
        if block is None:
            block = self._pending.get(key[0])
        if block is None or self._key[block] != key:
            return None
        return block

    def lookup(self, keys: Sequence[BlockKey]) -> list[int]:
        """Longest prefix of ``keys`` published here (a pending block does not count)."""
        hits = []
        for key in keys:
            block = self._index.get(key[0])
            if block is None or self._key[block] != key:
                break
            hits.append(block)
        return hits

    def clear(self) -> None:
        """Drop every unreferenced published block (a prefix-cache reset)."""
        for block in self._free:
            key = self._key[block]
            if key is not None:
                del self._index[key[0]]
                self._key[block] = None
                self._landed[block] = False
                self._num_empty += 1

    def check_idle(self) -> None:
        active = self._free.referenced()
        if active or self._free.num_active or self._pending or len(self._free) != self.num_blocks:
            raise AssertionError(
                f"host block leak: referenced={active[:16]} pending={list(self._pending)[:8]} "
                f"free={len(self._free)}/{self.num_blocks}"
            )
