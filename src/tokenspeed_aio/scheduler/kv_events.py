"""KV-cache block events, accumulated inside the scheduler and drained once per round.

Both tiers share one hash chain and one log: a block's key is the same whether the device
pool (``GPU``) or the host pool (``CPU``, the L2 tier) holds it, and every event names its
medium, as vLLM's KV events do. The drained batch is the round's net change per block and
medium: a block that is evicted and cached again (or cached and evicted) within one round
in the same tier produces no event (Principle 5).
"""

from __future__ import annotations

import msgspec

GPU = "GPU"  # the device KV pool
CPU = "CPU"  # the L2 host KV pool


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    """A full block entered the prefix cache of ``medium``."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    medium: str = GPU


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    """A cached block left ``medium`` (its pages were handed to a new owner)."""

    block_hash: int
    medium: str = GPU


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    """The whole prefix cache was dropped (every tier)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Net per-round accumulator; insertion order is publication order."""

    def __init__(self) -> None:
        self._pending: dict[tuple[int, str], BlockStored | BlockRemoved] = {}
        self._cleared = False

    def stored(
        self,
        block_hash: int,
        parent_hash: int | None,
        tokens: tuple[int, ...],
        medium: str = GPU,
    ) -> None:
        key = (block_hash, medium)
        if isinstance(self._pending.pop(key, None), BlockRemoved):
            return  # removed then stored again in one round: no net change
        self._pending[key] = BlockStored(block_hash, parent_hash, tokens, medium)

    def removed(self, block_hash: int, medium: str = GPU) -> None:
        key = (block_hash, medium)
        if isinstance(self._pending.pop(key, None), BlockStored):
            return  # stored then removed in one round: no net change
        self._pending[key] = BlockRemoved(block_hash, medium)

    def cleared(self) -> None:
        self._pending.clear()
        self._cleared = True

    def drain(self) -> list[KVEvent]:
        events: list[KVEvent] = [AllBlocksCleared()] if self._cleared else []
        events.extend(self._pending.values())
        self._pending.clear()
        self._cleared = False
        return events
