"""The scheduler's configuration, and its state as declared once for the halves of
``Scheduler`` (scheduler.py): the admission (admission.py), transfer (transfers.py) and
reporting (reporting.py) methods read and change what ``Scheduler.__init__`` sets up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenspeed_aio.scheduler.host_tier import HostTierConfig

if TYPE_CHECKING:
    from collections import deque

    from tokenspeed_aio.scheduler.block_pool import BlockPool
    from tokenspeed_aio.scheduler.host_tier import HostTier
    from tokenspeed_aio.scheduler.plan import ScheduledRow
    from tokenspeed_aio.scheduler.request import Request
    from tokenspeed_aio.scheduler.storage import StorageTier


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # including the null block
    page_size: int
    max_num_seqs: int  # running requests, = request-pool slots
    max_num_batched_tokens: int  # per-round token budget (chunked_prefill_size)
    max_model_len: int
    enable_prefix_caching: bool = True
    role: str = "plain"  # prefill / decode: one side of a disaggregated deployment
    host: HostTierConfig | None = None  # the L2 host pool and snapshot pool; None: off
    storage: bool = False  # the L3 storage tier (needs the host tier and prefix caching)

    def __post_init__(self) -> None:
        if self.storage and (self.host is None or not self.enable_prefix_caching):
            raise ValueError("the L3 storage tier needs the L2 host tier and prefix caching")


class SchedulerState:
    config: SchedulerConfig
    role: str
    page_size: int
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    pool: BlockPool
    host_tier: HostTier | None
    storage: StorageTier | None
    num_retractions: int
    forward_rounds: int
    forward_tokens: int
    _free_slots: list[int]
    _inflight: dict[int, tuple[list[Request], list[ScheduledRow]]]
