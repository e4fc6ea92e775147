"""What the control gate reads from the round (ControlView) and what the round applies
after it (ControlStep)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed_aio.scheduler.request import Request
from tokenspeed_aio.wire.messages import TokenOutput


@dataclass(frozen=True, slots=True)
class ControlView:
    """The round's state at the head, as the gate reads it."""

    drained: bool  # no request in the scheduler or the grammar queue, nothing in flight
    can_clear_cache: bool  # the scheduler's non-mutating flush check


@dataclass(slots=True)
class ControlStep:
    """What the round applies after the gate, before it plans."""

    requests: list[Request]  # to submit now (held ones released, and this round's)
    constrained: list[Request]  # to the grammar queue now
    refusals: list[TokenOutput] = field(default_factory=list)
    abort_all: bool = False  # end every request the output processor owns (pause abort)
    flush_cache: bool = False  # reset the scheduler's prefix cache now
    allow_forward: bool = True  # False: a frozen round
    idle_forward: bool = True  # may join a peer's forward (not while memory is released)
