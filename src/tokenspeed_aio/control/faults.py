"""Fault injection for resilience tests: ``TOKENSPEED_INJECT_FAULT=rank=R,round=N``
raises a rank-local error on global rank R at the end of its N-th round. Unset (the
default) it is never constructed and costs nothing."""

from __future__ import annotations

import os

ENV = "TOKENSPEED_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """The rank-local error a resilience test asked for."""


class FaultInjector:
    def __init__(self, rank: int, round_index: int) -> None:
        self.rank = rank
        self.round_index = round_index
        self.rounds = 0

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector | None:
        spec = os.environ.get(ENV)
        if not spec:
            return None
        fields = dict(part.split("=", 1) for part in spec.split(","))
        if int(fields["rank"]) != rank:
            return None
        return cls(rank, int(fields["round"]))

    def tick(self) -> None:
        self.rounds += 1
        if self.rounds == self.round_index:
            raise InjectedFault(f"injected fault on rank {self.rank} in round {self.rounds}")
