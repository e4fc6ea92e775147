"""Attention data parallelism: the replicas' schedulers differ, their forwards run in
step. Each round every rank shares its batch's size; a rank with nothing to run
runs an idle forward when another has work. The same exchange tells every rank
whether the whole engine is idle (the only time a round may wait for messages)."""

from __future__ import annotations

from typing import Protocol


class DpGroup(Protocol):
    async def all_gather(self, value: object, *, error: str | None = None) -> list: ...


class DpAgreement:
    def __init__(self, group: DpGroup) -> None:
        self.group = group
        self.engine_idle = False  # every rank idle as of the last round's exchange

    async def agree(self, num_tokens: int, locally_idle: bool, error: str | None = None) -> bool:
        """True when this rank must run an idle forward this round. A rank-local error
        rides the exchange: every rank raises the same CollectiveError."""
        shares = await self.group.all_gather((num_tokens, locally_idle), error=error)
        self.engine_idle = all(idle for _, idle in shares)
        return num_tokens == 0 and any(n for n, _ in shares)
