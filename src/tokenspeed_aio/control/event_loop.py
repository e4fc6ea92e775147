"""EventLoop.round(): the schedule of one scheduling round, top to bottom.

    1. receive + relay (with L3, every member's storage report rides the same exchange);
       admit in arrival order; the control gate (pause edges, held
       admissions, memory release, the same-round gate's weight op); the grammar queue;
       PD transfers register
    2. head: cache-op acknowledgments (replica-agreed), the agreed storage reports and
       client aborts (their transfers cancel) -> scheduler.advance_head, so this round's
       plan sees them
    3. plan: scheduler.next_execution_plan() (no forward in a frozen round); count its
       tokens (the iteration histogram) and its cache ops; submit its storage ops to the L3 executor; finish plan.aborts; DP
       agreement
    4. dispatch one data_plane.execute(plan) when there is device work -- a batch, a cache
       op or a remote stream (committing the queue first if the dispatch depends on a
       pending commit); commit from the in-flight queue down to the effective depth (0 when
       nothing dispatched); the replica's agreement on transfer progress
    5. tail: scheduler.advance(events); publish KV events once; send outputs + load and
       the control replies

The loop coordinates; every subsystem enters as one call and returns what the
round applies. The scheduler advances only here, at the head and the tail.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from tokenspeed_aio.collective.errors import CollectiveError, MeshError
from tokenspeed_aio.control.batch_log import BatchLog
from tokenspeed_aio.control.cache_ops import CacheOps
from tokenspeed_aio.control.control import Control
from tokenspeed_aio.control.control_step import ControlView
from tokenspeed_aio.control.data_plane import DataPlane, PendingExecution
from tokenspeed_aio.control.dispatch_rules import depends_on_pending_commit
from tokenspeed_aio.control.dp import DpAgreement
from tokenspeed_aio.control.faults import FaultInjector
from tokenspeed_aio.control.grammar import GrammarQueue
from tokenspeed_aio.control.ingress import Ingress
from tokenspeed_aio.control.kv_events import KVEventPublisher
from tokenspeed_aio.control.output import OutputProcessor
from tokenspeed_aio.control.pd import PdTransfers
from tokenspeed_aio.control.relay import Relay
from tokenspeed_aio.control.round_stats import RoundStats
from tokenspeed_aio.control.storage import StorageOpError, StorageOps
from tokenspeed_aio.control.transport import HEARTBEAT_SECONDS, LoadReporter
from tokenspeed_aio.scheduler.admission import SubmissionRejected
from tokenspeed_aio.scheduler.plan import (
    ExecutionPlan,
    ForwardCommitted,
    RequestFinished,
    TransferEvent,
)
from tokenspeed_aio.scheduler.request import Request
from tokenspeed_aio.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

Event = ForwardCommitted | RequestFinished | TransferEvent

GRAMMAR_POLL_SECONDS = 0.005  # an idle engine checks its compiling grammars this often
CACHE_POLL_SECONDS = 0.0005  # a round with only cache copies in flight waits this long
TRANSFER_POLL_SECONDS = 0.002  # ... and its KV transfers in flight this often
STORAGE_POLL_SECONDS = 0.002  # ... and its L3 storage operations this often


class EventLoop:
    def __init__(
        self,
        *,
        scheduler: Scheduler,
        data_plane: DataPlane,
        relay: Relay,
        ingress: Ingress,
        output: OutputProcessor,
        grammar: GrammarQueue,
        in_flight_depth: int,
        replica: int = 0,
        dp: DpAgreement | None = None,
        faults: FaultInjector | None = None,
        control: Control | None = None,
        batch_log: BatchLog | None = None,
        cache_ops: CacheOps | None = None,
        pd: PdTransfers | None = None,
        storage: StorageOps | None = None,
    ) -> None:
        if in_flight_depth not in (0, 1):
            raise ValueError(f"in_flight_depth must be 0 or 1, got {in_flight_depth}")
        self.scheduler = scheduler
        self.data_plane = data_plane
        self.relay = relay
        self.ingress = ingress
        self.output = output
        self.grammar = grammar
        self.depth = in_flight_depth
        self.dp = dp
        self.faults = faults
        self.control = control or Control(data_plane)
        self.batch_log = batch_log or BatchLog(0)
        self.cache_ops = cache_ops or CacheOps(relay.group)
        self.pd = pd or PdTransfers(None)
        self.storage = storage  # the L3 storage tier's agreement; None: no L3
        self.local_error: str | None = None  # carried into the next exchange with peers
        self.kv_events = KVEventPublisher()
        self.load_reporter = LoadReporter(replica)
        self.stats = RoundStats()
        self.in_flight: deque[tuple[ExecutionPlan, PendingExecution]] = deque()
        self.stopping = False
        self.jit = (0, 0.0)  # the data plane's serving-time JIT compiles, as last reported

    def idle(self) -> bool:
        return not self.in_flight and not self.scheduler.has_work()

    def quiet(self) -> bool:
        """Nothing progresses here without a new message: idle, or frozen (a keep pause,
        released memory) with nothing in flight, no control operation pending and no cache
        copy still landing."""
        if self.in_flight or self.control.busy or self.cache_ops.open or self._storage_open:
            return False
        return self.control.frozen or not self.scheduler.has_work()

    def engine_idle(self) -> bool:
        """Quiet here and, with attention DP, on every rank as of the last exchange."""
        return self.quiet() and (self.dp is None or self.dp.engine_idle)

    def _receive_timeout(self) -> float | None:
        """A round waits for messages only when the whole engine is idle: up to a
        heartbeat, or briefly while grammars compile and nothing else runs; and briefly
        when all it waits for is cache copies landing."""
        if not self.engine_idle():
            if self.in_flight or self.scheduler.running:
                return None
            if self.cache_ops.open:
                return CACHE_POLL_SECONDS
            return STORAGE_POLL_SECONDS if self._storage_open else None
        if len(self.grammar):
            return GRAMMAR_POLL_SECONDS
        return TRANSFER_POLL_SECONDS if self.pd.in_flight else HEARTBEAT_SECONDS

    async def run(self) -> None:
        """Run rounds until a stop request (a closed frontend reads as one); then end
        every request.

        With peers, a rank-local error does not leave the loop at once: it rides the
        next round's exchange (the relay, the DP agreement), where every rank raises the
        same CollectiveError -- no rank strands a peer inside a collective."""
        while not self.stopping:
            try:
                await self.round()
            except Exception as err:
                agreed = isinstance(err, (MeshError, CollectiveError))
                if agreed or not self.has_peers or self.local_error:
                    raise
                logger.exception("rank-local error; reporting it in the next exchange")
                self.local_error = f"{type(err).__name__}: {err}"
        await self.drain()

    async def round(self) -> None:
        # 1. receive + relay, admit in arrival order; the grammar queue
        report, error = self._storage_report()
        messages = await self.relay.receive(self._receive_timeout(), error=error, report=report)
        self.stats.begin()
        adm = self.ingress.admit(messages, owned=self._owned, held=self.scheduler.holds)
        step = await self.control.gate(
            adm,
            ControlView(self._drained(), self.scheduler.can_clear_cache()),
            self.dp.gate_shares if self.dp is not None else None,
        )
        self.output.send(adm.refusals + step.refusals)
        self.output.register(step.requests + step.constrained)
        self.output.fail(self.grammar.enqueue(step.constrained))
        compiled, failed = await self.grammar.admit() if len(self.grammar) else ([], [])
        self.output.fail(failed)
        self.pd.register(self._submit(compiled + step.requests))
        # 2. head
        acknowledged = await self.cache_ops.acknowledged(self.data_plane.poll_cache_results)
        aborted = self.output.abort(adm.aborted)
        if step.abort_all:  # a pause in abort mode, or weights invalidated
            aborted += self.output.abort_all()
        if step.flush_cache:  # a weight update's or a KV release's (agreed in the gate)
            self.scheduler.reset_prefix_cache()
        self.grammar.abort(aborted)
        self.pd.cancel(aborted)
        stored = self.storage.agree(self.relay.reports) if self.storage is not None else ()
        self.scheduler.advance_head(aborted, acknowledged, stored, self._store_up)
        # 3. plan
        plan = self.scheduler.next_execution_plan(allow_forward=step.allow_forward)
        self.load_reporter.planned(plan.num_tokens)
        self.cache_ops.dispatched(plan)
        self._submit_storage(plan)
        self.output.finish_planned_aborts(plan.aborts)
        if (
            self.dp is not None
            and await self.dp.agree(
                plan.num_tokens,
                self.quiet(),
                error=self.local_error,
                gate=self.control.share(self._drained()),
                stop=adm.stop,
            )
            and step.idle_forward
        ):
            await self.data_plane.idle_forward()
        # 4. dispatch, commit
        events: list[Event] = []
        if plan.needs_device():
            if self.in_flight and depends_on_pending_commit(plan):
                while self.in_flight:
                    events += await self._commit_oldest()
            self.in_flight.append((plan, self.data_plane.execute(plan)))
        depth = self.depth if plan.needs_device() else 0
        while len(self.in_flight) > depth:
            events += await self._commit_oldest()
        events += self.output.settle(await self.pd.agree(error=self.local_error))
        # 5. tail
        self.scheduler.advance(events)
        self.kv_events.publish(self.scheduler.drain_kv_events())
        self._send_outputs()
        # With attention DP the stop is agreed: every replica stops after the same round.
        self.stopping = self.stopping or (self.dp.stop if self.dp is not None else adm.stop)
        self.stats.end(len(self.scheduler.running), plan.num_tokens)
        self.batch_log.record(plan, self.scheduler.load)
        if self.faults is not None:
            self.faults.tick()

    @property
    def _storage_open(self) -> int:
        return self.storage.open if self.storage is not None else 0

    @property
    def _store_up(self) -> bool:
        """The store is up on every member, as last agreed (True without L3)."""
        return self.storage is None or self.storage.store_up

    def _storage_report(self):
        """This rank's storage report for the round's exchange, and the error the exchange
        carries: the rank-local one, or the report's broken rule (with no peers it raises:
        the rank stops)."""
        if self.storage is None:
            return None, self.local_error
        report = self.data_plane.poll_storage()
        problem = self.storage.check(report)
        if problem and not self.has_peers:
            raise StorageOpError(problem)
        error = self.local_error or (f"StorageOpError: {problem}" if problem else None)
        return report.wire(), error

    def _submit_storage(self, plan: ExecutionPlan) -> None:
        if self.storage is not None:
            ops = self.storage.dispatched(plan)
            if ops:
                self.data_plane.submit_storage(ops)

    def _owned(self, rid: str) -> bool:
        return self.output.owns(rid) or self.control.holds(rid)

    def _drained(self) -> bool:
        """No request in the scheduler or the grammar queue and nothing in flight."""
        return not self.in_flight and not self.scheduler.has_work() and not len(self.grammar)

    def _submit(self, requests: list[Request]) -> list[Request]:
        """One submission batch, refused whole (each request fails with its error);
        returns what was submitted."""
        if not requests:
            return requests
        try:
            self.scheduler.submit(requests)
        except SubmissionRejected as err:
            self.output.fail((req, str(err)) for req in requests)
            return []
        return requests

    async def _commit_oldest(self) -> list[Event]:
        plan, pending = self.in_flight.popleft()
        since = self.stats.clocks()
        result = await pending.result()
        self.stats.waited(since)
        self.jit = (result.jit_compiles, result.jit_compile_seconds)
        return self.output.commit(plan, result)

    def _send_outputs(self) -> None:
        replies = self.control.take_replies()
        load = self.cache_ops.report(self.scheduler.load())
        if self.storage is not None:
            load = self.storage.report(load)
        batch = self.load_reporter.batch(
            self.output.take(),
            load,
            self.jit,
            replies,
            self.pd.gauges(),
            self.pd.take_records() + (self.storage.take_records() if self.storage else []),
        )
        if batch is not None:
            self.relay.send(batch)

    async def drain(self) -> None:
        """Stop: commit what is in flight, end every request with an abort, land the cache
        copies still open (frozen rounds: cache work only), release."""
        events: list[Event] = []
        while self.in_flight:
            events += await self._commit_oldest()
        self.scheduler.advance(events)
        self.output.send(self.control.end_held())
        aborted = self.output.abort_all()
        self.grammar.abort(aborted)
        self.pd.cancel(aborted)
        self.scheduler.advance_head(aborted)
        while self.scheduler.has_cache_work():
            acknowledged = await self.cache_ops.acknowledged(self.data_plane.poll_cache_results)
            stored = await self._drain_storage()
            self.scheduler.advance_head((), acknowledged, stored, self._store_up)
            plan = self.scheduler.next_execution_plan(allow_forward=False)
            self._submit_storage(plan)
            if plan.needs_device():
                self.cache_ops.dispatched(plan)
                self.in_flight.append((plan, self.data_plane.execute(plan)))
                self.scheduler.advance(await self._commit_oldest())
            elif self.cache_ops.open or self._storage_open:
                await asyncio.sleep(CACHE_POLL_SECONDS)
        self.kv_events.publish(self.scheduler.drain_kv_events())
        self._send_outputs()

    async def _drain_storage(self) -> list:
        """At stop, the storage reports' agreement without the relay (it carries no more
        rounds): a gather of its own while a storage op is open, like the cache ops'."""
        if not self._storage_open:
            return []
        report, error = self._storage_report()
        group = self.relay.group
        reports = [report] if group is None else await group.all_gather(report, error=error)
        return self.storage.agree(reports)

    @property
    def has_peers(self) -> bool:
        return self.relay.group is not None or self.dp is not None

    def check_idle(self) -> None:
        """Leak check: no request state in the control plane or the scheduler."""
        if self.in_flight:
            raise AssertionError(f"{len(self.in_flight)} forwards still in flight")
        self.cache_ops.check_idle()
        if self.storage is not None:
            self.storage.check_idle()
        self.output.check_idle()
        self.scheduler.check_idle()
