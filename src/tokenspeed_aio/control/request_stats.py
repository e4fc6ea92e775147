"""The operator's per-request line (``--log-request-stats``): when a request ends, its
finish reason, tokens, prefix-cache hit, queue time, time to first token and latency, as
the rank saw them (from its submission to the scheduler)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("tokenspeed_aio.requests")


class RequestStats:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def finished(
        self,
        rid: str,
        reason: str,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        submitted_at: float,
        queue_seconds: float,
        first_token_at: float | None,
    ) -> None:
        now = time.monotonic()
        ttft = f"{first_token_at - submitted_at:.4f}s" if first_token_at else "-"
        logger.info(
            "request %s finished (%s): prompt %d tokens (%d cached), output %d tokens; "
            "queue %.4fs, ttft %s, e2e %.4fs",
            rid, reason, prompt_tokens, cached_tokens, output_tokens, queue_seconds, ttft,
            now - submitted_at,
        )  # fmt: skip
