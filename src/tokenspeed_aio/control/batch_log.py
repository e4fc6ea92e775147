"""The operator's per-round batch line (``--log-batch-interval N``): every N rounds that ran
a forward, one line with what runs and waits, the last round's batch, the throughput and
prefix-cache hit rate over those N rounds, and the KV pool's use. Off (N = 0), a round
pays one comparison."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenspeed_aio.scheduler.plan import ExecutionPlan
from tokenspeed_aio.wire.messages import Load

logger = logging.getLogger("tokenspeed_aio.batch")


class BatchLog:
    def __init__(self, interval: int, replica: int = 0) -> None:
        self.interval = interval
        self.replica = replica
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self._since = now
        self._rounds = 0
        self._tokens = 0  # forwarded positions (prefill chunks and decodes)
        self._generated = 0  # sampled tokens
        self._prompt = 0  # prompt tokens of first admissions
        self._cached = 0  # of those, served from the prefix cache

    def record(self, plan: ExecutionPlan, load_of: Callable[[], Load]) -> None:
        if not self.interval or not plan.num_tokens:
            return
        self._rounds += 1
        self._tokens += plan.num_tokens
        for row in plan.rows:
            self._generated += row.sample
            owner = row.new_owner
            if (
                owner is not None
                and row.output_index == 0
                and row.start <= len(owner.prompt_token_ids)
            ):
                self._prompt += len(owner.prompt_token_ids)
                self._cached += row.start  # a first admission starts after its prefix hit
        if self._rounds < self.interval:
            return
        load = load_of()
        now = time.monotonic()
        seconds = max(now - self._since, 1e-9)
        hit = self._cached / self._prompt if self._prompt else 0.0
        used = load.active_blocks / load.total_blocks if load.total_blocks else 0.0
        logger.info(
            "replica %d batch: running %d, waiting %d, batch %d tokens (%d rows); %.1f gen "
            "tok/s, %.1f tok/s over %d rounds; cache hit %.1f%%; KV %d/%d blocks (%.1f%%)",
            self.replica, load.running, load.waiting, plan.num_tokens, len(plan.rows),
            self._generated / seconds, self._tokens / seconds, self._rounds, 100 * hit,
            load.active_blocks, load.total_blocks, 100 * used,
        )  # fmt: skip
        self._reset(now)
