"""Drive one run of a workload against a target and record what each request saw.

Times are ``time.perf_counter()`` at the consumer: when the request was handed to
the target, and when each streamed output that carried tokens arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from tokenspeed_aio.bench.targets import Target
from tokenspeed_aio.bench.workloads import Conversation, Run
from tokenspeed_aio.control.round_stats import RoundSample


@dataclass
class RequestRecord:
    conversation: int  # index of the conversation in its run
    turn: int
    prompt_len: int
    output_len: int  # requested
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of outputs with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each of them carried
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


@dataclass
class RunResult:
    run: Run
    records: list[RequestRecord]
    duration: float  # first request sent to last output received, seconds
    rounds: list[RoundSample] | None  # control-plane rounds of this run (in-process only)
    # Device busy/idle time over the run's forwards (in-process on CUDA only).
    timeline: dict[str, float] | None = None


async def _one(target: Target, record: RequestRecord, prompt: list[int]) -> None:
    record.start = time.perf_counter()
    try:
        async for chunk in target.stream(prompt, record.output_len):
            if chunk.new_ids:
                record.chunk_times.append(time.perf_counter())
                record.chunk_tokens.append(len(chunk.new_ids))
                record.output_ids.extend(chunk.new_ids)
            record.cached_tokens = chunk.cached_tokens
    except Exception as err:  # one failed request is reported, not fatal to the run
        record.error = f"{type(err).__name__}: {err}"


async def _conversation(
    target: Target,
    index: int,
    conversation: Conversation,
    t0: float,
    gate: asyncio.Semaphore | None,
    records: list[RequestRecord],
) -> None:
    delay = t0 + conversation.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    async with gate or contextlib.nullcontext():
        history: list[int] = []  # every prompt and reply token so far
        for k, turn in enumerate(conversation.turns):
            history += turn.new_ids
            record = RequestRecord(index, k, len(history), turn.output_len)
            records.append(record)
            await _one(target, record, list(history))
            if not record.ok:
                return  # later turns would resend a conversation that never happened
            history += record.output_ids


async def execute(target: Target, run: Run) -> RunResult:
    """Send the run's conversations (each at its arrival, at most ``concurrency`` at once) and
    wait for every reply."""
    await target.settle()
    mark = target.round_mark()
    await target.forward_timeline()  # forget the forwards before this run
    gate = asyncio.Semaphore(run.concurrency) if run.concurrency else None
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    await asyncio.gather(
        *(_conversation(target, i, c, t0, gate, records) for i, c in enumerate(run.conversations))
    )
    ends = [r.chunk_times[-1] for r in records if r.chunk_times]
    duration = (max(ends) if ends else time.perf_counter()) - t0
    await target.settle()
    timeline = await target.forward_timeline()
    return RunResult(run, records, duration, target.rounds_since(mark), timeline)


async def warm_up(target: Target, prompt: list[int], output_len: int = 4) -> None:
    """One short request before measuring: first-call costs are not part of any run."""
    [_ async for _ in target.stream(prompt, output_len)]
