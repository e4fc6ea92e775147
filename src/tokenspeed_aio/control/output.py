"""Committing forwards: request output state, stop conditions, the scheduler's events
and the frontend's outputs.

The output processor owns a request from admission until its final output; it
decides when a request ends (stop token, EOS, max_tokens, context length, abort)
and tells the scheduler through events the round applies at its tail.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from itertools import repeat

from tokenspeed_aio.control.request_stats import RequestStats
from tokenspeed_aio.scheduler.plan import (
    ExecutionPlan,
    ForwardCommitted,
    ForwardResult,
    PlannedAbort,
    RequestFinished,
    TokenLogprobs,
)
from tokenspeed_aio.scheduler.request import Request
from tokenspeed_aio.wire.messages import TokenOutput


def refusal(rid: str, status: int, message: str | None, reason: str = "error") -> TokenOutput:
    """The final output of a request that never ran."""
    return TokenOutput(
        rid=rid,
        token_ids=[],
        finished=True,
        finish_reason=reason,
        error_status=status,
        error_message=message,
    )


class OutputState:
    __slots__ = (
        "first_at",
        "max_output",
        "min_tokens",
        "num_output",
        "prompt_logprobs",
        "req",
        "sent_first",
        "stop_ids",
        "wants_logprobs",
    )

    def __init__(self, req: Request, eos_token_ids: frozenset[int]) -> None:
        self.req = req  # read-only here: prompt length, params, cached tokens
        self.num_output = 0
        self.sent_first = False
        self.first_at: float | None = None  # when its first output was committed
        params = req.params
        # Read by every commit of the request: kept here rather than behind req.params.
        self.max_output = req.max_output
        self.min_tokens = params.min_tokens
        self.wants_logprobs = params.logprobs is not None
        stop_ids = frozenset() if params.ignore_eos else eos_token_ids
        if params.stop_token_ids:
            stop_ids = stop_ids | frozenset(params.stop_token_ids)
        self.stop_ids = stop_ids  # usually the processor's one EOS set, not a copy
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None  # the first token has none
        )


class OutputProcessor:
    def __init__(
        self, *, eos_token_ids: Iterable[int], request_stats: RequestStats | None = None
    ) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.request_stats = request_stats if request_stats and request_stats.enabled else None
        self._states: dict[str, OutputState] = {}
        self._pending: dict[str, TokenOutput] = {}  # this round's outputs, one per request

    def owns(self, rid: str) -> bool:
        return rid in self._states

    def register(self, requests: Sequence[Request]) -> None:
        for req in requests:
            self._states[req.rid] = OutputState(req, self.eos_token_ids)

    def send(self, outputs: Iterable[TokenOutput]) -> None:
        """Queue final outputs decided elsewhere (refusals of requests never owned)."""
        for out in outputs:
            self._pending[out.rid] = out

    def fail(self, failures: Iterable[tuple[Request, str]], status: int = 400) -> None:
        """End owned requests with an error (a refused submission batch, a grammar that
        did not compile)."""
        for req, message in failures:
            if req.rid in self._states:
                self._end(req.rid, "error", status=status, message=message)

    def abort(self, rids: Iterable[str]) -> list[str]:
        """Client aborts: end the streams now; returns the rids the scheduler must drop."""
        aborted = []
        for rid in rids:
            if rid in self._states:
                self._end(rid, "abort")
                aborted.append(rid)
        return aborted

    def finish_planned_aborts(self, aborts: Sequence[PlannedAbort]) -> None:
        """Requests the plan build gave up on; the scheduler already released them."""
        for abort in aborts:
            if abort.rid in self._states:
                self._end(abort.rid, "abort", status=503, message=abort.message)

    def commit(
        self, plan: ExecutionPlan, result: ForwardResult
    ) -> list[ForwardCommitted | RequestFinished]:
        states = self._states
        if result.prompt_logprobs:
            for rid, lps in result.prompt_logprobs.items():
                if rid in states:
                    states[rid].prompt_logprobs.extend(lps)
        pending = self._pending
        tokens = result.tokens
        # One token (and logprob) per sampling row, in row order; usually every row samples.
        rows = plan.rows if len(tokens) == len(plan.rows) else plan.sample_rows
        logprobs = repeat(None) if result.logprobs is None else result.logprobs
        accepted: list[int | None] = []
        finished: list[RequestFinished] = []
        # Runs for every running request every round: the common path (a token appended,
        # no stop) is kept to local, dict and attribute reads.
        for row, token, lp in zip(rows, tokens, logprobs):
            rid = row.rid
            state = states.get(rid)
            if state is None:
                accepted.append(None)  # ended while this forward was in flight: drop it
                continue
            accepted.append(token)
            out = pending.get(rid)
            if out is None:  # the request's first token this round: its output starts here
                out = pending[rid] = TokenOutput(rid, [token])
                if not state.sent_first:
                    self._first_output(out, state)
            else:
                out.token_ids.append(token)
            if lp is not None and state.wants_logprobs:
                if out.logprobs is None:
                    out.logprobs = []
                out.logprobs.append(lp)
            state.num_output = num_output = state.num_output + 1
            matcher = row.grammar  # the request's matcher, on its sampling rows
            if matcher is not None:  # the commit advances the grammar (Principle 4)
                if not matcher.accept_token(token):
                    message = f"the grammar rejected token {token}"
                    self._end(rid, "error", status=500, message=message)
                    finished.append(RequestFinished(rid))
                    continue
                if matcher.is_terminated():
                    stop_reason = token if token in state.stop_ids else None
                    self._end(rid, "stop", stop_reason=stop_reason)
                    finished.append(RequestFinished(rid))
                    continue
            if token in state.stop_ids and num_output >= state.min_tokens:
                self._end(rid, "stop", stop_reason=token)
                finished.append(RequestFinished(rid))
            elif num_output >= state.max_output:
                self._end(rid, "length")
                finished.append(RequestFinished(rid))
        return [ForwardCommitted(plan.plan_id, accepted), *finished]

    def _output(self, rid: str, state: OutputState) -> TokenOutput:
        """The request's output of this round, started on first use."""
        out = self._pending.get(rid)
        if out is None:
            out = self._pending[rid] = TokenOutput(rid, [])
            if not state.sent_first:
                self._first_output(out, state)
        return out

    @staticmethod
    def _first_output(out: TokenOutput, state: OutputState) -> None:
        """The request's first output also carries what the client learns once."""
        state.sent_first = True
        state.first_at = time.monotonic()
        out.num_prompt_tokens = state.req.prompt_len
        out.num_cached_tokens = state.req.num_cached_tokens
        out.queue_seconds = state.req.queue_seconds
        out.prompt_logprobs = state.prompt_logprobs

    def _end(
        self,
        rid: str,
        reason: str,
        *,
        stop_reason: int | None = None,
        status: int = 0,
        message: str | None = None,
    ) -> None:
        state = self._states.pop(rid)
        out = self._output(rid, state)
        if self.request_stats is not None:
            req = state.req
            self.request_stats.finished(
                rid,
                reason,
                prompt_tokens=req.prompt_len,
                cached_tokens=req.num_cached_tokens,
                output_tokens=state.num_output,
                submitted_at=req.submitted_at or time.monotonic(),
                queue_seconds=req.queue_seconds,
                first_token_at=state.first_at,
            )
        out.finished = True
        out.finish_reason = reason
        out.stop_reason = stop_reason
        out.error_status = status
        out.error_message = message

    def take(self) -> list[TokenOutput]:
        outputs = list(self._pending.values())
        self._pending.clear()
        return outputs

    def abort_all(self) -> list[str]:
        return self.abort(list(self._states))

    def check_idle(self) -> None:
        if self._states or self._pending:
            raise AssertionError(
                f"output processor still owns {list(self._states)[:8]}, "
                f"pending outputs {list(self._pending)[:8]}"
            )
