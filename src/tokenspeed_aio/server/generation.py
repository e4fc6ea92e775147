"""Runs one HTTP request's engine requests (prompts × n choices) and merges their
outputs: each choice is one ``frontend.generate()`` stream consumed by its own
task; the tasks are cancelled and awaited whenever the merged stream closes
(the response finished, failed, or its client left), and cancelling a
generate() stream aborts its engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

import msgspec

from tokenspeed_aio.api.frontend import ASYNC_TOKENIZE_CHARS, Frontend
from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.server.errors import ApiError
from tokenspeed_aio.server.metrics import ServerMetrics
from tokenspeed_aio.server.request_registry import RequestRegistry
from tokenspeed_aio.tokenization.tokenizer import Tokenizer
from tokenspeed_aio.wire.messages import Bootstrap

DEFAULT_MAX_BACKLOG = 512  # undelivered tokens per choice before a stream is cut off
# Choices started per event-loop turn: a fan-out of thousands starts in slices, so a
# request arriving meanwhile is read, admitted and submitted between two slices.
START_SLICE = 64


class StreamBacklogError(ApiError):
    """A streaming client stopped reading: its backlog passed the bound."""

    def __init__(self, message: str) -> None:
        super().__init__(429, message, code="stream_backlog_exceeded")


@dataclass(slots=True)
class Job:
    """One engine request: one choice of one prompt."""

    index: int  # the choice's index in the response: prompt_index * n + i
    prompt_index: int
    rid: str  # the engine request id
    prompt_ids: list[int]
    params: SamplingParams  # n == 1
    bootstrap: Bootstrap | None = None  # its half of a disaggregated request (PD)


async def tokenize(
    tokenizer: Tokenizer, texts: Sequence[str], add_special_tokens: bool
) -> list[list[int]]:
    """Token ids of each text; long inputs are tokenized off the event loop."""
    if sum(len(t) for t in texts) <= ASYNC_TOKENIZE_CHARS:
        return [tokenizer.encode(t, add_special_tokens) for t in texts]
    return list(
        await asyncio.gather(*(tokenizer.encode_async(t, add_special_tokens) for t in texts))
    )


def make_jobs(
    frontend: Frontend, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> list[Job]:
    """Validate every prompt against ``params`` and fan out ``params.n`` choices each,
    choice k with the engine rid ``f"{request_id}-{k}"``. A seeded request gives
    choice i of a prompt the seed ``seed + i``: the choices differ, and choice 0
    reproduces the same request made with n=1."""
    n = params.n
    single = msgspec.structs.replace(params, n=1)
    jobs = []
    for p, ids in enumerate(prompts):
        frontend.validate(ids, single)
        for i in range(n):
            choice = p * n + i
            seeded = single
            if params.seed is not None and i:
                seeded = msgspec.structs.replace(single, seed=params.seed + i)
            jobs.append(Job(choice, p, f"{request_id}-{choice}", ids, seeded))
    return jobs


class Fanout:
    """An HTTP request's running choices. Consume them once, by ``outputs()`` (each
    choice's cumulative outputs) or by ``events(render)`` (a stream: the response's
    bytes); ``abort()`` ends choices early with finish_reason "abort" (POST
    /abort_request).

    Backpressure: what the consumer has not taken yet (the response writer waits while
    its client does not read) is held compactly. ``outputs()``: a choice's outputs merge
    into one, the newest, carrying every delta since the consumer last took one.
    ``events()``: each delta output is rendered to bytes as it arrives and appended to
    one buffer, so a slow client's backlog is bytes, not the many small objects of its
    tokens and logprobs (whose freed memory the allocator would keep). Past
    ``max_backlog`` undelivered tokens in a choice what is held is dropped, every
    choice is aborted (freeing its KV blocks), and the consumer's next item is a
    StreamBacklogError."""

    def __init__(
        self,
        frontend: Frontend,
        metrics: ServerMetrics,
        registry: RequestRegistry,
        request_id: str,
        jobs: list[Job],
        max_backlog: int = DEFAULT_MAX_BACKLOG,
    ) -> None:
        self.frontend = frontend
        self.metrics = metrics
        self.registry = registry
        self.request_id = request_id
        self.jobs = jobs
        self.max_backlog = max_backlog
        self._tasks: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()
        self._ended: set[str] = set()  # choices whose final output (or error) is queued
        # The choices with an output to take, in the order their first such output came.
        self._queue: asyncio.Queue[Job | BaseException] = asyncio.Queue()
        self._held: dict[str, RequestOutput] = {}  # by rid: the output to take (queued)
        self._unstarted = 0  # jobs[_unstarted:] have no task yet
        # events(): the rendered bytes not taken yet, each choice's tokens in them, the
        # choices not finished, the first error, and a flag for the waiting consumer.
        self._render: Callable[[Job, RequestOutput], bytes] | None = None
        self._events = bytearray()
        self._pending: dict[str, int] = {}
        self._unfinished = len(jobs)
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._registered = False

    def register(self) -> None:
        """Register under the request's ids (RequestConflictError when one is taken), once:
        a streamed response registers before its headers go out, so that a conflict is its
        status (409), and then owns the registration (``release`` when it is done)."""
        if not self._registered:
            self.registry.add(self)
            self._registered = True

    def release(self) -> None:
        """Unregister; nothing when already unregistered."""
        self.registry.remove(self)

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncGenerator[None, None]:
        """Registered and starting its choices; on exit every choice is cancelled and
        awaited (cancelling one aborts its engine request)."""
        self.register()  # first: a request racing us for an id is refused here
        self._start_slice()
        starter = asyncio.create_task(self._start_rest(), name=f"{self.request_id}-start")
        try:
            yield
        finally:
            self.release()
            starter.cancel()
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(starter, *self._tasks.values(), return_exceptions=True)

    async def outputs(self) -> AsyncGenerator[tuple[Job, RequestOutput], None]:
        """(job, cumulative output) in arrival order until every choice finished. An
        engine error of any choice is raised here (the other choices are aborted)."""
        queue = self._queue
        remaining = len(self.jobs)
        async with self._running():
            while remaining:
                job = queue.get_nowait() if queue.qsize() else await queue.get()
                if isinstance(job, BaseException):
                    raise job
                out = self._held.pop(job.rid)
                if out.finished:
                    remaining -= 1
                yield job, out

    async def events(
        self, render: Callable[[Job, RequestOutput], bytes]
    ) -> AsyncGenerator[bytes, None]:
        """The bytes ``render`` made of each choice's delta outputs, in arrival order,
        as much as has come each time, until every choice finished; an error (the
        engine's, render's, the backlog's) is raised after the bytes before it."""
        self._render = render
        # What was offered before this consumer came (a registered stream aborted before
        # its events started: each choice's abort output) is rendered first.
        while self._queue.qsize():
            job = self._queue.get_nowait()
            if isinstance(job, BaseException):
                self._fail(job)
            else:
                self._append(job, self._held.pop(job.rid))
        async with self._running():
            while True:
                if self._events:
                    data = bytes(self._events)
                    self._events.clear()
                    self._pending.clear()
                    yield data
                elif self._error is not None:
                    raise self._error
                elif not self._unfinished:
                    return
                else:
                    self._ready.clear()
                    await self._ready.wait()

    def _start_slice(self) -> None:
        """Start the next START_SLICE choices; a choice aborted before its start ends
        at once with an abort output (it never reaches the engine)."""
        end = min(self._unstarted + START_SLICE, len(self.jobs))
        for job in self.jobs[self._unstarted : end]:
            if job.rid in self._aborted:
                continue  # abort() queued its final output
            task = self._tasks[job.rid] = asyncio.create_task(self._run(job), name=job.rid)
            task.add_done_callback(functools.partial(self._settled, job))
        self._unstarted = end

    async def _start_rest(self) -> None:
        while self._unstarted < len(self.jobs):
            await asyncio.sleep(0)  # one event-loop turn: other requests' I/O runs
            self._start_slice()

    def abort(self, rid: str | None = None) -> list[str]:
        """End one choice (its engine rid) or all; returns the rids still running."""
        running = [r for r, t in self._tasks.items() if not t.done() and (rid is None or r == rid)]
        for r in running:
            self._aborted.add(r)
            self._tasks[r].cancel()
        for job in self.jobs[self._unstarted :]:
            if (rid is None or job.rid == rid) and job.rid not in self._aborted:
                self._aborted.add(job.rid)
                self._end(job.rid)
                self._offer(job, self._abort_output(job.rid, None))
                running.append(job.rid)
        return running

    def _offer(self, job: Job, out: RequestOutput) -> bool:
        """Hold ``out`` for the consumer (rendered, or merged into the choice's output
        still waiting); False when the choice's undelivered tokens passed the bound."""
        if self._render is not None:
            return self._append(job, out)
        held = self._held.get(job.rid)
        self._held[job.rid] = out
        if held is None:
            self._queue.put_nowait(job)
            return True
        out.delta_text = held.delta_text + out.delta_text
        out.delta_token_ids = held.delta_token_ids + out.delta_token_ids
        return len(out.delta_token_ids) <= self.max_backlog

    def _append(self, job: Job, out: RequestOutput) -> bool:
        if out.finished:
            self._unfinished -= 1
        try:
            self._events += self._render(job, out)
        except Exception as exc:  # the consumer raises it
            self._fail(exc)
            return True
        self._ready.set()
        pending = self._pending.get(job.rid, 0) + len(out.delta_token_ids)
        self._pending[job.rid] = pending
        return pending <= self.max_backlog

    def _fail(self, exc: BaseException) -> None:
        """Hand the consumer an error (events(): the first one)."""
        if self._render is None:
            self._queue.put_nowait(exc)
        elif self._error is None:
            self._error = exc
            self._ready.set()

    def _overflow(self) -> None:
        """The consumer fell too far behind: drop what it has not taken, abort every
        choice, and leave it the error."""
        queue = self._queue
        while queue.qsize():
            queue.get_nowait()
        self._held.clear()
        self._events.clear()
        self._unstarted = len(self.jobs)  # the rest never start
        self._ended.update(self._tasks)
        self.registry.remove(self)  # aborted: all that is left is the error for the client
        self._fail(
            StreamBacklogError(
                f"the client read the stream too slowly: more than {self.max_backlog} "
                f"tokens of one choice were waiting to be sent (--max-stream-backlog); "
                "the request was aborted"
            )
        )
        for task in self._tasks.values():
            if task is not asyncio.current_task():
                task.cancel()

    def _end(self, rid: str) -> None:
        """A choice's final output (or error) is queued. Once every choice's is, what is left
        is output the client has not read: the request no longer holds sequences, nor its
        ids or the admission room they count against."""
        self._ended.add(rid)
        if len(self._ended) == len(self.jobs):
            self.registry.remove(self)

    def _settled(self, job: Job, task: asyncio.Task) -> None:
        """A choice aborted before its task ever ran ends here: a task cancelled before
        its first step runs none of its code, so _run never queued its final output."""
        if job.rid not in self._ended and job.rid in self._aborted:
            self._end(job.rid)
            self._offer(job, self._abort_output(job.rid, None))

    async def _run(self, job: Job) -> None:
        stats = self.metrics.sequence(len(job.prompt_ids))
        last: RequestOutput | None = None
        reason = "abort"  # unless the engine says otherwise
        stream = self.frontend.generate(
            prompt_token_ids=job.prompt_ids,
            sampling_params=job.params,
            rid=job.rid,
            bootstrap=job.bootstrap,
            group=self.request_id,
            output_kind="cumulative" if self._render is None else "delta",
        )
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    stats.on_output(out)
                    last = out
                    if out.finished:
                        reason = out.finish_reason or "stop"
                        self._end(job.rid)
                    if not self._offer(job, out):
                        self._overflow()
                        return  # closing the stream aborts this choice
        except asyncio.CancelledError:
            if job.rid not in self._aborted:
                raise
            if last is None or not last.finished:  # it may have ended as the abort came
                self._end(job.rid)
                self._offer(job, self._abort_output(job.rid, last))
        except Exception as exc:
            reason = "error"
            self._end(job.rid)
            self._fail(exc)
        finally:
            stats.finish(reason)

    def _abort_output(self, rid: str, last: RequestOutput | None) -> RequestOutput:
        """The final output of a choice aborted by /abort_request: cumulative, what it
        had so far; a delta one, nothing new."""
        if last is None:
            return RequestOutput(rid, [], "", "", finished=True, finish_reason="abort")
        delta = self._render is not None
        logprobs = last.logprobs
        if delta and logprobs is not None:
            logprobs = []
        return RequestOutput(
            rid,
            [] if delta else last.token_ids,
            "" if delta else last.text,
            "",
            finished=True,
            finish_reason="abort",
            logprobs=logprobs,
            prompt_logprobs=last.prompt_logprobs,
            num_prompt_tokens=last.num_prompt_tokens,
            num_cached_tokens=last.num_cached_tokens,
            num_tokens=last.num_tokens,
        )
