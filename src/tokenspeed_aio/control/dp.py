"""Attention data parallelism: the replicas' schedulers differ, their forwards run in
step. Each round every rank shares its batch's size; a rank with nothing to run
runs an idle forward when another has work. The same exchange tells every rank
whether the whole engine is idle (the only time a round may wait for messages), and
whether any rank was told to stop: every rank then stops after that same round, so no
rank is left inside a collective its peers never join."""

from __future__ import annotations

from typing import Protocol


class DpGroup(Protocol):
    async def all_gather(self, value: object, *, error: str | None = None) -> list: ...


class DpAgreement:
    def __init__(self, group: DpGroup) -> None:
        self.group = group
        self.engine_idle = False  # every rank idle as of the last round's exchange
        # Every rank's control gate share (control/control.py) as of the last exchange: the
        # next round's gate decides from them, so its decision is rank-identical and
        # ordinary rounds add no collective.
        self.gate_shares: list = []
        self.stop = False  # some rank got a StopEngine by the last exchange

    async def agree(
        self,
        num_tokens: int,
        locally_idle: bool,
        error: str | None = None,
        gate: object = None,
        stop: bool = False,
    ) -> bool:
        """True when this rank must run an idle forward this round. A rank-local error
        rides the exchange: every rank raises the same CollectiveError. ``stop``: this
        rank was told to stop this round (``self.stop`` says whether any rank was)."""
        shares = await self.group.all_gather((num_tokens, locally_idle, gate, stop), error=error)
        self.engine_idle = all(idle for _, idle, _, _ in shares)
        self.gate_shares = [g for _, _, g, _ in shares]
        self.stop = self.stop or any(s for _, _, _, s in shares)
        return num_tokens == 0 and any(n for n, _, _, _ in shares)
