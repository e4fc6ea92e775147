"""The real EventLoop (Scheduler, Ingress, OutputProcessor, GrammarQueue, Relay over a
LocalTransport) over the model-free SimDataPlane: the round as production assembles it
(engine/rank.py), minus torch. A test puts wire messages on the transport, runs rounds
one at a time or until idle, and reads every output back as per-request streams.

Tokens are checked against ``expected`` (sim_device.reference with the output
processor's stop rules): the sim device samples from the sequence it reads back
through the block table, so a wrong table, a bad prefix hit, a page reused too early
or a dropped commit gives a wrong token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from helpers.sim_data_plane import SimDataPlane
from helpers.sim_device import SimDevice, reference
from helpers.sim_host import SimHostDevice
from helpers.sim_store import SimStorage, SimStore
from tokenspeed_aio.control.event_loop import EventLoop
from tokenspeed_aio.control.grammar import GrammarBackend, GrammarQueue
from tokenspeed_aio.control.ingress import Ingress
from tokenspeed_aio.control.output import OutputProcessor
from tokenspeed_aio.control.relay import Relay, ReplicaGroup
from tokenspeed_aio.control.storage import StorageOps
from tokenspeed_aio.control.transport import LocalTransport
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.plan import ExecutionPlan
from tokenspeed_aio.scheduler.scheduler import HostTierConfig, Scheduler, SchedulerConfig
from tokenspeed_aio.wire.messages import (
    AbortRequest,
    GenerateRequest,
    OutputBatch,
    StopEngine,
    TokenOutput,
)

DEFAULT_CONFIG = dict(
    num_blocks=64,
    page_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=512,
    enable_prefix_caching=True,
)


def expected(
    prompt: list[int], max_tokens: int, stop_ids: Iterable[int] = (), min_tokens: int = 0
) -> list[int]:
    """The greedy tokens of a request that runs to its end: the reference, cut after the
    first stop id at or past min_tokens."""
    stops = set(stop_ids)
    out = []
    for tok in reference(prompt, max_tokens):
        out.append(tok)
        if tok in stops and len(out) >= min_tokens:
            break
    return out


@dataclass
class Stream:
    """What the frontend received for one submission of a rid, in order."""

    rid: str
    outputs: list[TokenOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finished

    @property
    def tokens(self) -> list[int]:
        return [t for out in self.outputs for t in out.token_ids]

    @property
    def final(self) -> TokenOutput:
        assert self.finished, f"{self.rid} has not finished: {self.outputs}"
        return self.outputs[-1]

    @property
    def finish_reason(self) -> str | None:
        return self.final.finish_reason


class SimEngine:
    def __init__(
        self,
        *,
        depth: int = 0,
        eos_token_ids: Iterable[int] = (),
        grammar_backend: GrammarBackend | None = None,
        grammar_timeout: float = 5.0,
        group: ReplicaGroup | None = None,
        is_owner: bool = True,
        on_execute: Callable[[ExecutionPlan], None] | None = None,
        fail_plan: int | None = None,
        host: HostTierConfig | None = None,
        ack_delay: int = 0,
        store: SimStore | None = None,
        storage_delay: int = 0,
        storage_fail: float = 0.0,
        seed: int = 0,
        **config: int | bool,
    ) -> None:
        """``host``: the L2 host tier, on a sim device with host pages whose asynchronous
        cache ops land ``ack_delay`` rounds late at most (helpers/sim_host.py). ``store``:
        the L3 tier over that shared sim store, its ops ``storage_delay`` polls late at
        most, failing with probability ``storage_fail`` (helpers/sim_store.py)."""
        self.config = SchedulerConfig(
            **{**DEFAULT_CONFIG, **config}, host=host, storage=store is not None
        )
        cfg = self.config
        geometry = (cfg.num_blocks, cfg.page_size, cfg.max_num_seqs)
        if host is None:
            self.device = SimDevice(*geometry)
        else:
            self.device = SimHostDevice(
                *geometry,
                host.num_blocks,
                host.num_snapshot_pages,
                host.num_snapshot_states,
                ack_delay=ack_delay,
            )
        self.storage = None
        if store is not None:
            self.storage = SimStorage(
                store, self.device, delay=storage_delay, fail=storage_fail, seed=seed
            )
        self.data_plane = SimDataPlane(
            self.device, on_execute=on_execute, fail_plan=fail_plan, storage=self.storage
        )
        self.transport = LocalTransport() if is_owner else None
        self.loop = EventLoop(
            scheduler=Scheduler(cfg),
            data_plane=self.data_plane,
            relay=Relay(self.transport, group, is_owner=is_owner),
            ingress=Ingress(max_model_len=cfg.max_model_len),
            output=OutputProcessor(eos_token_ids=eos_token_ids),
            grammar=GrammarQueue(grammar_backend, grammar_timeout, group),
            in_flight_depth=depth,
            storage=StorageOps(len(group.group.ranks) if group else 1) if store else None,
        )
        self.streams: dict[str, list[Stream]] = {}
        self.batches: list[OutputBatch] = []
        self._posted = 0  # messages put since the last round

    @property
    def scheduler(self) -> Scheduler:
        return self.loop.scheduler

    # -- the frontend's side of the wire ----------------------------------------------
    def generate(
        self, rid: str, prompt: list[int], max_tokens: int | None = 16, *, seed: int = 0, **kw
    ) -> Stream:
        """Submit a greedy request; its stream (a repeat of a live rid joins the original's
        stream, as on the wire, where a stream is known by its rid alone)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
        self._put(GenerateRequest(rid, list(prompt), params, seed))
        streams = self.streams.setdefault(rid, [])
        if not streams or streams[-1].finished:
            streams.append(Stream(rid))
        return streams[-1]

    def abort(self, rid: str) -> None:
        self._put(AbortRequest(rid))

    def _put(self, msg) -> None:
        self.transport.put(msg)
        self._posted += 1

    def stream(self, rid: str) -> Stream:
        """The latest stream of rid."""
        return self.streams[rid][-1]

    def tokens(self) -> dict[str, list[int]]:
        """Every rid's latest stream's tokens."""
        return {rid: streams[-1].tokens for rid, streams in self.streams.items()}

    # -- rounds -----------------------------------------------------------------------
    async def round(self) -> None:
        """One round (on an idle engine, it waits up to a heartbeat for messages)."""
        self._posted = 0
        await self.loop.round()
        self.collect()

    def busy(self) -> bool:
        return bool(self._posted or not self.loop.idle() or len(self.loop.grammar))

    async def run(self, max_rounds: int = 5000) -> None:
        """Rounds until every message was received and nothing is left to run."""
        for _ in range(max_rounds):
            if not self.busy():
                return
            await self.round()
        raise AssertionError(f"did not drain in {max_rounds} rounds: {self.scheduler.requests}")

    async def rounds_until(self, done: Callable[[], bool], max_rounds: int = 1000) -> int:
        """Run rounds until ``done()``; returns how many ran."""
        for n in range(max_rounds):
            if done():
                return n
            await self.round()
        raise AssertionError(f"condition not met in {max_rounds} rounds")

    def collect(self) -> None:
        """Read the output batches already sent into the streams."""
        outputs = self.transport.outputs if self.transport is not None else None
        while outputs is not None and not outputs.empty():
            self._take(outputs.get_nowait())

    async def until_finished(self, stream: Stream, min_tokens: int | None = None) -> None:
        """With the loop running as a task: read batches as they come until the stream
        finished (or holds ``min_tokens`` tokens)."""
        while not stream.finished and (min_tokens is None or len(stream.tokens) < min_tokens):
            self._take(await self.transport.outputs.get())

    def _take(self, batch: OutputBatch) -> None:
        self.batches.append(batch)
        for out in batch.outputs:
            streams = self.streams.get(out.rid)
            assert streams, f"an output for {out.rid!r}, which was never submitted"
            assert not streams[-1].finished, f"an output for {out.rid!r} after its final one"
            streams[-1].outputs.append(out)

    async def shutdown(self) -> None:
        """Stop as the frontend does (a StopEngine), let the loop drain, leak-check: no
        request, block, slot or forward is left, and every stream got its final output."""
        self._put(StopEngine())
        await self.loop.run()
        self.collect()
        self.loop.check_idle()
        await self.data_plane.shutdown()
        open_streams = [s.rid for ss in self.streams.values() for s in ss if not s.finished]
        assert not open_streams, f"streams without a final output: {open_streams}"


async def at_depths(
    scenario: Callable[[SimEngine], Awaitable[None]], **kw
) -> dict[int, dict[str, list[int]]]:
    """Run a scenario on a fresh engine at in-flight depth 0 and 1 (each shut down and
    leak-checked); every rid's tokens by depth."""
    tokens = {}
    for depth in (0, 1):
        engine = SimEngine(depth=depth, **kw)
        await scenario(engine)
        await engine.shutdown()
        tokens[depth] = engine.tokens()
    return tokens
