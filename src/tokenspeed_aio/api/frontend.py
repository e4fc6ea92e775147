"""The frontend core shared by AsyncEngine and the HTTP server: tokenization,
request streams, detokenization, stop strings, and one output task per engine.

It talks to the engine through an EngineConnection (in-process or ZMQ) carrying
the wire's msgspec messages; it never touches the device or imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from tokenspeed_aio.api.control_calls import ControlCalls, ControlResult
from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.api.stream import OutputKind, RequestStream
from tokenspeed_aio.api.tracing import RequestTimeline, RequestTracer
from tokenspeed_aio.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    RequestConflictError,
)
from tokenspeed_aio.sampling_params import MAX_BANNED_IDS, SamplingParams
from tokenspeed_aio.tokenization.detokenizer import IncrementalDetokenizer
from tokenspeed_aio.tokenization.tokenizer import Tokenizer
from tokenspeed_aio.wire.control import ControlOp
from tokenspeed_aio.wire.messages import (
    AbortRequest,
    Bootstrap,
    GenerateRequest,
    InboundMessage,
    Load,
    OutputBatch,
    TransferRecord,
    Wake,
)

logger = logging.getLogger(__name__)

STALE_SECONDS = 3.0
ASYNC_TOKENIZE_CHARS = 16_384  # longer prompts are tokenized off the event loop


class EngineConnection(Protocol):
    def send(self, msg: InboundMessage, replica: int) -> None: ...

    async def receive(self) -> OutputBatch:
        """The next output batch; raises ConnectionError once the engine is gone."""
        ...

    async def close(self) -> None: ...


class Frontend:
    def __init__(
        self,
        tokenizer: Tokenizer,
        connection: EngineConnection,
        *,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
        num_replicas: int = 1,
        weight_version: str = "default",
        tracer: RequestTracer | None = None,
        role: str = "plain",
    ) -> None:
        self.tokenizer = tokenizer
        self.role = role  # plain, or a prefill / decode engine of a PD deployment
        self.connection = connection
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size  # the model's
        # A prompt's ids must embed (the model) and detokenize (the tokenizer).
        self.prompt_vocab_size = min(vocab_size, tokenizer.vocab_size)
        self.eos_token_ids = frozenset(eos_token_ids)  # banned with stop ids by min_tokens
        self.num_replicas = num_replicas
        self.streams: dict[str, RequestStream] = {}
        # Rids this side ended (client abort, stop string) whose final output from the
        # engine has not arrived yet: the wire names a stream by rid alone, so reusing
        # one now would hand the new stream the old request's tokens and its abort.
        self.draining: set[str] = set()
        self.loads: dict[int, tuple[Load, float]] = {}  # replica -> (load, receipt time)
        # Where the PD transfers the engine reports ended go (the server's metrics).
        self.on_transfers: Callable[[list[TransferRecord]], None] | None = None
        self.dead: EngineError | None = None
        self.calls = ControlCalls(num_replicas, weight_version)
        self.tracer = tracer
        self._task = asyncio.create_task(self._pump(), name="ts-frontend-outputs")
        self._task.add_done_callback(self._pump_done)

    # -- requests ---------------------------------------------------------------
    async def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        rid: str | None = None,
        bootstrap: Bootstrap | None = None,
        group: str = "",
        output_kind: OutputKind = "cumulative",
    ) -> AsyncIterator[RequestOutput]:
        """``group``: the client request this sequence belongs to; the scheduler admits
        requests in fair turns, so one request's many sequences cannot starve others
        ("": a request of its own). ``output_kind``: what each output carries
        (``RequestOutput``)."""
        params = sampling_params or SamplingParams()
        ids = await self._prompt_ids(prompt, prompt_token_ids)
        self.validate(ids, params, bootstrap)
        stream = self.submit(rid or uuid.uuid4().hex, ids, params, bootstrap, group, output_kind)
        try:
            while True:
                item = (
                    stream.queue.get_nowait() if stream.queue.qsize() else await stream.queue.get()
                )
                if isinstance(item, EngineError):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream.rid)
            self.streams.pop(stream.rid, None)

    async def _prompt_ids(
        self, prompt: str | None, prompt_token_ids: list[int] | None
    ) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("prompt: give exactly one of prompt or prompt_token_ids")
        if prompt_token_ids is not None:
            return list(prompt_token_ids)
        if len(prompt) > ASYNC_TOKENIZE_CHARS:
            return await self.tokenizer.encode_async(prompt)
        return self.tokenizer.encode(prompt)

    def validate(
        self, ids: list[int], params: SamplingParams, bootstrap: Bootstrap | None = None
    ) -> None:
        """Every client-facing check of a request (HTTP 400), made once, here: the rank
        checks only what it alone knows (a rid it still holds, its KV capacity)."""
        if bootstrap is not None:
            self._validate_bootstrap(params, bootstrap)
        if params.n != 1:
            raise InvalidRequestError(
                "n: one generate() call is one sequence; call it n times (the HTTP API fans "
                "n out for you)",
                param="n",
            )
        if not ids:
            raise InvalidRequestError("prompt: the prompt is empty", param="prompt")
        for name, values, limit in (
            ("prompt", ids, self.prompt_vocab_size),
            ("stop_token_ids", params.stop_token_ids, self.vocab_size),
            ("logit_bias", list(params.logit_bias or ()), self.vocab_size),
        ):
            bad = next((t for t in values if not 0 <= t < limit), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"{name}: token id {bad} is outside the vocabulary [0, {limit})", param=name
                )
        want = len(ids) + (params.max_tokens or 1)
        if want > self.max_model_len:
            raise InvalidRequestError(
                f"prompt: this model's maximum context length is {self.max_model_len} tokens, "
                f"but {want} were requested ({len(ids)} in the prompt, "
                f"{params.max_tokens or 1} to generate)",
                param="max_tokens" if params.max_tokens else "prompt",
            )
        if params.min_tokens > 0:
            banned = set(params.stop_token_ids) | (
                set() if params.ignore_eos else self.eos_token_ids
            )
            if len(banned) > MAX_BANNED_IDS:
                raise InvalidRequestError(
                    f"stop_token_ids: with min_tokens, at most {MAX_BANNED_IDS} distinct stop "
                    f"token ids (EOS included) can be held back, got {len(banned)}",
                    param="stop_token_ids",
                )

    def _validate_bootstrap(self, params: SamplingParams, bootstrap: Bootstrap) -> None:
        if self.role == "plain":
            raise InvalidRequestError(
                "bootstrap_room: this engine serves requests whole (--disaggregation-mode "
                "plain); send disaggregated requests to prefill and decode engines",
                param="bootstrap_room",
            )
        if not 0 <= bootstrap.room < 2**63:
            raise InvalidRequestError(
                f"bootstrap_room: must be in [0, 2**63), got {bootstrap.room}",
                param="bootstrap_room",
            )
        if not 0 < bootstrap.port < 65536 or not bootstrap.host:
            raise InvalidRequestError(
                f"bootstrap_host/bootstrap_port: {bootstrap.host!r}:{bootstrap.port} is not "
                "an address",
                param="bootstrap_port",
            )
        if self.role == "decode" and params.prompt_logprobs is not None:
            raise InvalidRequestError(
                "prompt_logprobs: a disaggregated decode engine does not compute the prompt "
                "(its prefill engine does); ask without echo/prompt logprobs",
                param="prompt_logprobs",
            )

    def submit(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        bootstrap: Bootstrap | None = None,
        group: str = "",
        output_kind: OutputKind = "cumulative",
    ) -> RequestStream:
        if self.dead is not None:
            raise self.dead
        if rid in self.streams:
            raise RequestConflictError(f"request id {rid!r} is already running", param="rid")
        if rid in self.draining:
            raise RequestConflictError(
                f"request id {rid!r} was just aborted and is still ending; use a new id",
                param="rid",
            )
        seed = params.seed % 2**63 if params.seed is not None else random.getrandbits(63)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        stream = RequestStream(rid, params, detok, self.route(), output_kind)
        replica = stream.replica
        self.streams[rid] = stream
        self.connection.send(GenerateRequest(rid, ids, params, seed, bootstrap, group), replica)
        for other in range(self.num_replicas):
            if other != replica:
                self.connection.send(Wake(), other)
        return stream

    def abort(self, rid: str) -> None:
        """End a request from outside its consumer: the stream gets a final ``abort``
        output, the engine an AbortRequest (which frees its blocks)."""
        stream = self.streams.pop(rid, None)
        if stream is None:
            return
        if stream.finished:
            return  # its final output arrived: the engine is done with it
        stream.finish_aborted()
        if self.dead is None:
            self.draining.add(rid)
            self.connection.send(AbortRequest(rid), stream.replica)

    def in_use(self, rid: str) -> bool:
        """Whether a new request may not take this id yet (running, or still ending)."""
        return rid in self.streams or rid in self.draining

    def route(self) -> int:
        """The replica with the lowest reported load (running + waiting), counting the
        requests sent since its last report so a burst spreads evenly."""
        if self.num_replicas == 1:
            return 0
        sent = [0] * self.num_replicas
        for stream in self.streams.values():
            sent[stream.replica] += 1

        def load(replica: int) -> int:
            report = self.loads.get(replica)
            reported = report[0].running + report[0].waiting if report else 0
            return max(reported, sent[replica])

        return min(range(self.num_replicas), key=load)

    # -- control operations ---------------------------------------------------------------
    async def control(self, op: ControlOp) -> ControlResult:
        """Send ``op`` to every replica (one call id, in the order of calls) and wait until
        each answered; the combined result (ok only if every replica's is)."""
        if self.dead is not None:
            raise self.dead
        call, future = self.calls.start(op)
        try:
            for replica in range(self.num_replicas):
                self.connection.send(call, replica)
            return await future
        finally:
            self.calls.forget(call.call_id)

    # -- health -------------------------------------------------------------------
    def stale_replicas(self) -> list[int]:
        now = time.monotonic()
        return [
            r
            for r in range(self.num_replicas)
            if r not in self.loads or now - self.loads[r][1] > STALE_SECONDS
        ]

    # -- outputs ------------------------------------------------------------------
    async def _pump(self) -> None:
        while True:
            batch = await self.connection.receive()
            self.loads[batch.replica] = (batch.load, time.monotonic())
            version = self.calls.weight_versions[batch.replica]
            if batch.transfers and self.on_transfers is not None:
                self.on_transfers(batch.transfers)
            for out in batch.outputs:
                if out.rid in self.draining:  # ended here; the engine's outputs are moot
                    if out.finished:
                        self.draining.discard(out.rid)
                    continue
                stream = self.streams.get(out.rid)
                if stream is None or stream.finished:
                    continue
                stream.weight_version = version
                if stream.process(out):
                    self.draining.add(out.rid)
                    self.connection.send(AbortRequest(out.rid), stream.replica)
                if stream.finished:
                    del self.streams[out.rid]
                    if self.tracer is not None:
                        self._trace(stream, out.finish_reason or "error")
            # After the outputs: a call answered in this batch finds its round's outputs
            # (a pause's aborts) already in their streams.
            if batch.replies:
                self.calls.received(batch.replica, batch.replies)

    def _trace(self, stream: RequestStream, reason: str) -> None:
        self.tracer.record(
            RequestTimeline(
                rid=stream.rid,
                arrival=stream.arrival,
                queue_seconds=stream.queue_seconds,
                first_token=stream.first_token_at,
                end=time.time(),
                finish_reason=reason,
                prompt_tokens=stream.num_prompt_tokens,
                cached_tokens=stream.num_cached_tokens,
                output_tokens=len(stream.token_ids),
                weight_version=stream.weight_version,
            )
        )

    def _pump_done(self, task: asyncio.Task) -> None:
        if self.dead is not None:
            return  # an orderly shutdown already failed what was left
        if task.cancelled():
            err: EngineError = EngineDeadError("the engine was shut down")
        else:
            exc = task.exception()
            logger.error("engine connection lost: %r", exc)
            err = EngineDeadError(f"the engine stopped: {exc}")
        self.fail_all(err)

    def fail_all(self, err: EngineError) -> None:
        self.dead = err
        self.calls.fail_all(err)
        for stream in self.streams.values():
            stream.finished = True
            stream.queue.put_nowait(err)
        self.streams.clear()
        self.draining.clear()

    async def close(self) -> None:
        """Stop the output task; the connection belongs to whoever opened it."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.close)
