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


CACHE_ACK_ENV = "TOKENSPEED_INJECT_CACHE_ACK"


class CacheAckFault:
    """``TOKENSPEED_INJECT_CACHE_ACK=duplicate|drop[,after=N]``: the data plane repeats (or
    loses) the acknowledgment of the N-th cache op that lands (default: the first), so a
    test sees the control plane catch it. Unset, it is never constructed."""

    MODES = ("duplicate", "drop")

    def __init__(self, mode: str, after: int = 1) -> None:
        if mode not in self.MODES:
            raise ValueError(f"{CACHE_ACK_ENV}: mode must be one of {self.MODES}, got {mode!r}")
        self.mode = mode
        self.after = after

    @classmethod
    def from_env(cls) -> CacheAckFault | None:
        spec = os.environ.get(CACHE_ACK_ENV)
        if not spec:
            return None
        mode, *rest = spec.split(",")
        fields = dict(part.split("=", 1) for part in rest)
        return cls(mode, int(fields.get("after", 1)))

    def acks(self, op_id: int, landed: int) -> list[int]:
        """The ACKs reported for the ``landed``-th op to land."""
        if landed != self.after:
            return [op_id]
        return [op_id, op_id] if self.mode == "duplicate" else []
