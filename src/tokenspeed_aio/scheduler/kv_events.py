"""KV-cache block events, accumulated inside the scheduler and drained once per round.

The drained batch is the round's net change: a block that is evicted and cached
again (or cached and evicted) within one round produces no event (Principle 5).
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    """A full block entered the prefix cache."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    """A cached block was evicted (its pages were handed to a new owner)."""

    block_hash: int


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    """The whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Net per-round accumulator; insertion order is publication order."""

    def __init__(self) -> None:
        self._pending: dict[int, BlockStored | BlockRemoved] = {}
        self._cleared = False

    def stored(self, block_hash: int, parent_hash: int | None, tokens: tuple[int, ...]) -> None:
        if isinstance(self._pending.pop(block_hash, None), BlockRemoved):
            return  # removed then stored again in one round: no net change
        self._pending[block_hash] = BlockStored(block_hash, parent_hash, tokens)

    def removed(self, block_hash: int) -> None:
        if isinstance(self._pending.pop(block_hash, None), BlockStored):
            return  # stored then removed in one round: no net change
        self._pending[block_hash] = BlockRemoved(block_hash)

    def cleared(self) -> None:
        self._pending.clear()
        self._cleared = True

    def drain(self) -> list[KVEvent]:
        events: list[KVEvent] = [AllBlocksCleared()] if self._cleared else []
        events.extend(self._pending.values())
        self._pending.clear()
        self._cleared = False
        return events
