"""A launched forward's results: host copies started after the forward's kernels,
read into plain Python once its event says they landed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenspeed_aio.scheduler.plan import ExecutionPlan, ForwardResult, ScheduledRow
from tokenspeed_aio.wire.messages import TokenLogprobs


@dataclass(slots=True)
class Landing:
    """Host-side tensors of one forward's results (pinned on CUDA)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    prompt_logprobs: torch.Tensor | None = None
    prompt_top_ids: torch.Tensor | None = None
    prompt_top_logprobs: torch.Tensor | None = None


def to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Start a device->host copy into pinned memory (no wait; the event fences it)."""
    if tensor is None or tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


class LaunchedForward:
    __slots__ = ("_landing", "_plan", "_prompt_rows", "event", "jit")

    def __init__(
        self,
        plan: ExecutionPlan,
        landing: Landing,
        prompt_rows: Sequence[ScheduledRow],
        event: torch.cuda.Event | None,
        jit: tuple[int, float],
    ) -> None:
        self._plan = plan
        self._landing = landing
        self._prompt_rows = prompt_rows
        self.event = event  # recorded after the result copies; None on CPU
        self.jit = jit  # serving-time JIT compiles and their seconds, so far

    def collect(self) -> ForwardResult:
        """Plain-Python results, read from the landed host copies."""
        land = self._landing
        result = ForwardResult(
            plan_id=self._plan.plan_id,
            tokens=land.tokens.tolist(),
            logprobs=None,
            jit_compiles=self.jit[0],
            jit_compile_seconds=self.jit[1],
        )
        if land.logprobs is not None:
            result.logprobs = token_logprobs(land.logprobs, land.top_ids, land.top_logprobs)
        if self._prompt_rows:
            flat = token_logprobs(
                land.prompt_logprobs, land.prompt_top_ids, land.prompt_top_logprobs
            )
            result.prompt_logprobs = {}
            i = 0
            for row in self._prompt_rows:
                n = len(row.prompt_logprob_targets)
                result.prompt_logprobs[row.rid] = [
                    TokenLogprobs(lp.logprob, lp.top[: row.prompt_logprobs])
                    for lp in flat[i : i + n]
                ]
                i += n
        return result


def no_forward(plan: ExecutionPlan, jit: tuple[int, float]) -> LaunchedForward:
    """The result of a plan with remote streams and no batch: nothing ran, nothing lands."""
    return LaunchedForward(plan, Landing(tokens=torch.empty(0, dtype=torch.int64)), (), None, jit)


def token_logprobs(
    logprobs: torch.Tensor, top_ids: torch.Tensor | None, top_logprobs: torch.Tensor | None
) -> list[TokenLogprobs]:
    lps = logprobs.tolist()
    if top_ids is None:
        return [TokenLogprobs(lp, []) for lp in lps]
    return [
        TokenLogprobs(lp, list(zip(ids, tops)))
        for lp, ids, tops in zip(lps, top_ids.tolist(), top_logprobs.tolist())
    ]
