"""One request's stream in the frontend: tokens, incremental text, stop strings, and the
queue its ``generate()`` consumer reads.

Its outputs are of one of two kinds (``OutputKind``). ``cumulative``: each output carries
every token, logprob and character generated so far, and the stream keeps them all.
``delta``: each carries only what is new, and the stream keeps no tokens or logprobs (a
long stream's frontend memory stays flat: what a streaming HTTP response needs)."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.errors import EngineError, error_from_status
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.tokenization.detokenizer import IncrementalDetokenizer, StopStrings
from tokenspeed_aio.wire.messages import TokenLogprobs, TokenOutput

OutputKind = Literal["cumulative", "delta"]
OUTPUT_KINDS = ("cumulative", "delta")


class RequestStream:
    """One request's stream: accumulates tokens and text, applies stop strings."""

    __slots__ = (
        "arrival",
        "delta",
        "detok",
        "finished",
        "first_token_at",
        "logprobs",
        "num_cached_tokens",
        "num_prompt_tokens",
        "num_tokens",
        "params",
        "prompt_logprobs",
        "queue",
        "queue_seconds",
        "replica",
        "rid",
        "sent",
        "stops",
        "text",
        "token_ids",
        "weight_version",
    )

    def __init__(
        self,
        rid: str,
        params: SamplingParams,
        detok: IncrementalDetokenizer,
        replica: int,
        kind: OutputKind = "cumulative",
    ) -> None:
        if kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind: {kind!r} is not one of {', '.join(OUTPUT_KINDS)}")
        self.rid = rid
        self.delta = kind == "delta"
        self.replica = replica  # the attention-DP replica serving it
        self.params = params
        self.detok = detok
        self.stops = StopStrings(params.stop, params.include_stop_str_in_output)
        self.token_ids: list[int] = []  # cumulative outputs only
        self.logprobs = [] if params.logprobs is not None and not self.delta else None
        self.num_tokens = 0
        self.text = ""  # kept by both kinds: stop strings search it
        self.sent = 0  # characters of text already emitted
        self.num_prompt_tokens = 0  # these three arrive with the first output
        self.num_cached_tokens = 0
        self.prompt_logprobs = None
        self.queue_seconds = 0.0
        self.finished = False
        self.weight_version = ""  # the serving replica's, set as outputs arrive
        self.arrival = time.time()  # wall clock, for traces
        self.first_token_at: float | None = None
        self.queue: asyncio.Queue[RequestOutput | EngineError] = asyncio.Queue()

    def finish_aborted(self) -> None:
        self.finished = True
        self.queue.put_nowait(self._output(self.sent, "", True, "abort", None, [], []))

    def _output(
        self,
        visible: int,
        delta: str,
        finished: bool,
        reason: str | None,
        stop_reason: int | str | None,
        delta_ids: list[int],
        delta_logprobs: list[TokenLogprobs] | None,
    ) -> RequestOutput:
        if self.delta:
            ids, text = delta_ids, delta
            logprobs = delta_logprobs if self.params.logprobs is not None else None
        else:
            ids, text = list(self.token_ids), self.text[:visible]
            logprobs = list(self.logprobs) if self.logprobs is not None else None
        return RequestOutput(
            rid=self.rid,
            token_ids=ids,
            text=text,
            delta_text=delta,
            finished=finished,
            finish_reason=reason,
            stop_reason=stop_reason,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            queue_seconds=self.queue_seconds,
            delta_token_ids=delta_ids,
            weight_version=self.weight_version,
            num_tokens=self.num_tokens,
        )

    def process(self, out: TokenOutput) -> bool:
        """Apply one engine output; True when a stop string ended the request here
        (the engine must be told to abort it)."""
        if out.error_status:
            self.finished = True
            self.queue.put_nowait(error_from_status(out.error_status, out.error_message or ""))
            return False
        if out.num_prompt_tokens:
            self.num_prompt_tokens = out.num_prompt_tokens
            self.num_cached_tokens = out.num_cached_tokens
            self.prompt_logprobs = out.prompt_logprobs
            self.queue_seconds = out.queue_seconds
        if out.token_ids and self.first_token_at is None:
            self.first_token_at = time.time()
        self.num_tokens += len(out.token_ids)
        if not self.delta:
            self.token_ids.extend(out.token_ids)
            if out.logprobs is not None and self.logprobs is not None:
                self.logprobs.extend(out.logprobs)
        new_text = self.detok.step(out.token_ids) if out.token_ids else ""
        if out.finished:
            new_text += self.detok.flush()
        self.text += new_text
        finished, reason, stop_reason = out.finished, out.finish_reason, out.stop_reason
        stopped_here = False
        if self.stops.stops and new_text:
            hit = self.stops.check(self.text, len(new_text))
            if hit is not None:
                self.text, stop_reason = hit
                stopped_here = not finished
                finished, reason = True, "stop"
        visible = self.stops.releasable(self.text, finished)
        delta = self.text[self.sent : visible]
        self.sent = max(self.sent, visible)
        self.finished = finished
        self.queue.put_nowait(
            self._output(
                visible, delta, finished, reason, stop_reason, out.token_ids, out.logprobs or []
            )
        )
        return stopped_here
