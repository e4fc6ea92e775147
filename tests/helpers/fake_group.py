"""An in-process collective group for control-plane tests (torch-free, no sockets): the
members' ``all_gather`` calls meet in one asyncio loop, k-th call with k-th call, as
collective.Group's do over the mesh. A member that passes ``error`` makes every member
raise the same CollectiveError from that call (the exchange itself completed)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from tokenspeed_aio.collective.errors import CollectiveError


@dataclass
class _Exchange:
    values: dict[int, object] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    left: int = 0  # members yet to read the result


class FakeGroup:
    def __init__(self, size: int) -> None:
        self.size = size
        self.ranks = tuple(range(size))
        self._exchanges: dict[int, _Exchange] = {}
        self.members = [FakeMember(self, rank) for rank in self.ranks]

    def member(self, rank: int) -> FakeMember:
        return self.members[rank]

    async def _gather(self, rank: int, k: int, value, error, timeout) -> list:
        ex = self._exchanges.setdefault(k, _Exchange(left=self.size))
        ex.values[rank] = value
        if error is not None:
            ex.errors[rank] = error
        if len(ex.values) == self.size:
            ex.done.set()
        if timeout is None or math.isinf(timeout):
            await ex.done.wait()
        else:
            await asyncio.wait_for(ex.done.wait(), timeout)
        ex.left -= 1
        if not ex.left:
            del self._exchanges[k]
        if ex.errors:
            raise CollectiveError("all_gather", self.ranks, sorted(ex.errors.items()))
        return [ex.values[r] for r in self.ranks]


class FakeMember:
    """One member's view: collective.Group's ``all_gather`` signature."""

    def __init__(self, group: FakeGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.calls = 0

    async def all_gather(
        self, value: object, *, error: str | None = None, timeout: float | None = None
    ) -> list:
        k, self.calls = self.calls, self.calls + 1
        return await self.group._gather(self.rank, k, value, error, timeout)
