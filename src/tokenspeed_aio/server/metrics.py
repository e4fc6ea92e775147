"""Prometheus metrics of the serving process (aioprometheus; names ``tokenspeed:*``).

Request-level metrics are recorded by the HTTP layer per engine request (one
choice of one prompt); the engine's load (running, waiting, KV blocks) is read
from the replicas' latest load reports when /metrics is scraped, so the gauges
return to idle as soon as the engine reports a cancelled request gone.
"""

from __future__ import annotations

import bisect
import time
from typing import ClassVar

import psutil
from aioprometheus import Counter, Gauge, Histogram, Registry, histogram, render

from tokenspeed_aio.api.frontend import Frontend
from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.wire.messages import ITERATION_TOKEN_BUCKETS, TransferRecord

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)  # fmt: skip
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip
L3_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
              10.0, 30.0)  # fmt: skip
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)  # fmt: skip
NO_LABELS: dict[str, str] = {}


def published(bounds, counts, observations: int, total: float) -> histogram.Histogram:
    """aioprometheus's aggregate of ``counts`` per bucket of ``bounds`` (the last one,
    +Inf, included): cumulative, as Prometheus exposes them."""
    merged = histogram.Histogram(*bounds)
    below = 0
    for bound, count in zip(merged.buckets, counts, strict=True):
        below += count
        merged.buckets[bound] = below
    merged.observations = observations
    merged.sum = total
    return merged


class RequestHistogram:
    """A histogram without labels that every engine request's outputs observe: counted per
    bucket by bisection (aioprometheus's own observe walks every bucket, ~14 us), and
    published into its aioprometheus metric when /metrics renders."""

    __slots__ = ("bounds", "counts", "metric", "observations", "total")

    def __init__(self, metric: Histogram) -> None:
        self.metric = metric
        self.bounds = [*metric.upper_bounds, float("inf")]
        self.counts = [0] * len(self.bounds)
        self.observations = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.observations += 1
        self.total += value

    def publish(self) -> None:
        if self.observations:
            merged = published(self.bounds, self.counts, self.observations, self.total)
            self.metric.set_value(NO_LABELS, merged)


class ServerMetrics:
    """The registry behind GET /metrics."""

    def __init__(self, frontend: Frontend, model_name: str) -> None:
        self.frontend = frontend
        self.registry = Registry()
        labels = {"model_name": model_name}

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tokenspeed:{name}", doc, const_labels=labels, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenspeed:{name}", doc, const_labels=labels, registry=self.registry)

        def request_histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return RequestHistogram(histogram(name, doc, buckets))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"tokenspeed:{name}", doc, const_labels=labels, registry=self.registry,
                buckets=buckets,
            )  # fmt: skip

        self.finished = counter(
            "request_success_total", "Engine requests finished, by finish reason."
        )
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens_total", "Generated tokens.")
        self.rejected = counter("http_requests_rejected_total", "HTTP requests answered 4xx.")
        self.running = gauge("num_requests_running", "Requests running (all replicas).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting (all replicas).")
        self.resident_blocks = gauge("kv_blocks_resident", "KV blocks holding tokens.")
        self.active_blocks = gauge("kv_blocks_active", "KV blocks held by live requests.")
        self.total_blocks = gauge("kv_blocks_total", "KV blocks in the pools.")
        self.ttft = request_histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.tpot = request_histogram(
            "time_per_output_token_seconds", "Time between output tokens.", TPOT_BUCKETS
        )
        self.e2e = request_histogram(
            "e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS
        )
        self.queue_time = request_histogram(
            "request_queue_time_seconds",
            "Scheduler submission to the request's first forward.",
            TTFT_BUCKETS,
        )
        # The frontend's own load, each stage of the chain from HTTP to the engine: what a
        # leak anywhere in it would leave above zero once the server is idle.
        self.http_requests = gauge("http_requests_running", "HTTP generation requests running.")
        self.http_sequences = gauge(
            "http_sequences_running", "Choices of the running HTTP requests (prompts x n)."
        )
        self.frontend_streams = gauge(
            "frontend_streams", "Engine requests whose outputs the frontend is streaming."
        )
        self.frontend_draining = gauge(
            "frontend_draining_rids",
            "Request ids ended in the frontend whose final output the engine has not sent yet.",
        )
        self.jit_compiles = gauge(
            "jit_serving_compiles", "JIT compilations on the forward threads since serving."
        )
        self.jit_seconds = gauge(
            "jit_serving_compile_seconds", "Seconds those serving-time compilations took."
        )
        self.cache = CacheMetrics(counter, gauge)
        # Prefill/decode disaggregation, by role: a prefill engine times each send (its
        # writes, until every one was acknowledged), a decode engine each receive (from
        # advertising its landing pages to the KV and first token landing).
        self.pd_transfers = counter("pd_transfers_total", "KV transfers ended, by outcome.")
        self.pd_bytes = counter("pd_transfer_bytes_total", "KV bytes transferred (all ranks).")
        self.pd_seconds = histogram(
            "pd_transfer_seconds", "Duration of completed KV transfers.", TRANSFER_BUCKETS
        )
        self.pd_gbps = gauge(
            "pd_transfer_throughput_gbps", "Bytes over seconds of completed transfers (GB/s)."
        )
        self.pd_in_flight = gauge("pd_rooms_in_flight", "KV transfers the engine tracks.")
        self.pd_unclaimed = gauge(
            "pd_rooms_unclaimed", "Rooms a prefill peer holds for a request or claim to come."
        )
        self.pd_quarantined = gauge(
            "pd_pages_quarantined", "Landing pages held until a lost prefill peer stops."
        )
        self._pd_totals: dict[str, list[float]] = {}  # role -> [bytes, seconds] of ok ones
        # The L3 storage tier's operations, by kind (query, get, put) and outcome
        self.l3_ops = counter("l3_ops_total", "L3 storage operations ended, by kind and outcome.")
        self.l3_seconds = histogram(
            "l3_op_seconds",
            "L3 storage operations' latency (submission to replica-agreed completion).",
            L3_BUCKETS,
        )
        frontend.on_transfers = self.transfers
        self.prefix_queries = counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "prefix_cache_hits_total", "Prompt tokens served from the prefix cache."
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens per engine round that forwarded a batch (prefill and decode).",
            ITERATION_TOKEN_BUCKETS,
        )
        self.rank_rss = gauge(
            "engine_resident_memory_bytes", "Resident memory of the engine's rank processes."
        )
        # The Prometheus client's standard process metrics, of this (the frontend) process.
        process = dict(registry=self.registry)
        self.rss = Gauge("process_resident_memory_bytes", "Resident memory size.", **process)
        self.vms = Gauge("process_virtual_memory_bytes", "Virtual memory size.", **process)
        self.cpu = Gauge("process_cpu_seconds_total", "User and system CPU time.", **process)
        self.fds = Gauge("process_open_fds", "Open file descriptors.", **process)
        self.start_time = Gauge(
            "process_start_time_seconds", "Start time since the epoch.", **process
        )
        self._process = psutil.Process()

    def transfers(self, records: list[TransferRecord]) -> None:
        for rec in records:
            if rec.role.startswith("l3_"):
                kind = {"kind": rec.role.removeprefix("l3_")}
                self.l3_ops.inc({**kind, "outcome": rec.outcome})
                self.l3_seconds.observe({**kind, "outcome": rec.outcome}, rec.seconds)
                continue
            role = {"role": rec.role}
            self.pd_transfers.inc({**role, "outcome": rec.outcome})
            self.pd_bytes.add(role, rec.num_bytes)
            if rec.outcome == "ok":
                self.pd_seconds.observe(role, rec.seconds)
                totals = self._pd_totals.setdefault(rec.role, [0.0, 0.0])
                totals[0] += rec.num_bytes
                totals[1] += rec.seconds
                if totals[1] > 0:
                    self.pd_gbps.set(role, totals[0] / totals[1] / 1e9)

    def client_error(self, status: int) -> None:
        self.rejected.inc({"status": str(status)})

    def sequence(self, num_prompt_tokens: int) -> SequenceStats:
        """Start timing one engine request (call at its arrival)."""
        return SequenceStats(self, num_prompt_tokens)

    def render(
        self, accept: list[str], *, http_requests: int, http_sequences: int
    ) -> tuple[bytes, dict[str, str]]:
        """The exposition text, with the load gauges refreshed from the latest reports and
        from the frontend's state (the HTTP layer's running requests and their choices)."""
        self.http_requests.set(NO_LABELS, http_requests)
        self.http_sequences.set(NO_LABELS, http_sequences)
        self.frontend_streams.set(NO_LABELS, len(self.frontend.streams))
        self.frontend_draining.set(NO_LABELS, len(self.frontend.draining))
        loads = [load for load, _ in self.frontend.loads.values()]
        self.running.set(NO_LABELS, sum(x.running for x in loads))
        self.waiting.set(NO_LABELS, sum(x.waiting for x in loads))
        self.resident_blocks.set(NO_LABELS, sum(x.resident_blocks for x in loads))
        self.active_blocks.set(NO_LABELS, sum(x.active_blocks for x in loads))
        self.total_blocks.set(NO_LABELS, sum(x.total_blocks for x in loads))
        self.jit_compiles.set(NO_LABELS, sum(x.jit_compiles for x in loads))
        self.jit_seconds.set(NO_LABELS, sum(x.jit_compile_seconds for x in loads))
        self.cache.refresh(loads)
        self.pd_in_flight.set(NO_LABELS, sum(x.pd_in_flight for x in loads))
        self.pd_unclaimed.set(NO_LABELS, sum(x.pd_unclaimed_rooms for x in loads))
        self.pd_quarantined.set(NO_LABELS, sum(x.pd_quarantined_pages for x in loads))
        self._iteration_histogram(loads)
        for h in (self.ttft, self.tpot, self.e2e, self.queue_time):
            h.publish()
        self._process_metrics()
        return render(self.registry, accept)

    def _iteration_histogram(self, loads) -> None:
        """The replicas' round counts by bucket (each replica's since its start), summed."""
        bounds = [*ITERATION_TOKEN_BUCKETS, float("inf")]
        counts = [sum(x.iteration_buckets[i] for x in loads if x.iteration_buckets)
                  for i in range(len(bounds))]  # fmt: skip
        rounds, tokens = sum(x.forward_rounds for x in loads), sum(x.forward_tokens for x in loads)
        self.iteration_tokens.set_value(NO_LABELS, published(bounds, counts, rounds, float(tokens)))

    def _process_metrics(self) -> None:
        proc = self._process
        with proc.oneshot():
            memory, times = proc.memory_info(), proc.cpu_times()
            self.rss.set(NO_LABELS, memory.rss)
            self.vms.set(NO_LABELS, memory.vms)
            self.cpu.set(NO_LABELS, times.user + times.system)
            self.fds.set(NO_LABELS, proc.num_fds())
            self.start_time.set(NO_LABELS, proc.create_time())
        ranks = 0
        for child in proc.children(recursive=True):
            try:
                ranks += child.memory_info().rss
            except psutil.Error:  # exited between the listing and the read
                continue
        self.rank_rss.set(NO_LABELS, ranks)


class CacheMetrics:
    """The host KV tiers and preemptions, from the replicas' load reports: totals since
    start are set from the reports' running counts (each replica's rank keeps them)."""

    # metric suffix -> (CacheLoad field, help)
    COUNTERS: ClassVar[dict[str, tuple[str, str]]] = {
        "l2_hit_tokens_total": ("l2_hit_tokens", "Prompt tokens loaded back from the L2 tier."),
        "l2_load_backs_total": ("load_backs", "L2 load-backs acknowledged."),
        "l2_load_back_bytes_total": ("load_back_bytes", "Bytes loaded back from L2."),
        "l2_load_back_seconds_total": (
            "load_back_seconds",
            "Load-back latency (dispatch to acknowledgment), summed over load-backs.",
        ),
        "l2_write_backs_total": ("write_backs", "L2 write-backs acknowledged."),
        "l2_write_back_bytes_total": ("write_back_bytes", "Bytes written back to L2."),
        "l2_write_back_seconds_total": (
            "write_back_seconds",
            "Write-back latency (dispatch to acknowledgment), summed over write-backs.",
        ),
        "retraction_images_total": ("images", "Retraction victims stored to the host tiers."),
        "l3_queries_total": ("l3_queries", "Requests whose prefix was queried in L3."),
        "l3_query_hit_tokens_total": (
            "l3_query_hit_tokens",
            "Prompt tokens an L3 query found in the store.",
        ),
        "l3_fetched_tokens_total": ("l3_fetched_tokens", "Prompt tokens fetched from L3 into L2."),
        "l3_recomputed_tokens_total": (
            "l3_recomputed_tokens",
            "Prompt tokens found in L3 but recomputed (a failed or timed-out fetch, L2 full).",
        ),
        "l3_get_bytes_total": ("l3_get_bytes", "Bytes fetched from L3 (all ranks)."),
        "l3_put_bytes_total": ("l3_put_bytes", "Bytes published to L3 (all ranks)."),
        "l3_failures_total": ("l3_failures", "L3 operations failed (timeouts included)."),
        "l3_timeouts_total": ("l3_timeouts", "L3 operations that timed out."),
        "retraction_restores_total": ("restores", "Retraction images restored into a slot."),
    }
    GAUGES: ClassVar[dict[str, tuple[str, str]]] = {
        "l2_blocks_total": ("host_total_blocks", "Blocks of the L2 host KV pools."),
        "l3_requests_preparing": ("l3_preparing", "Requests waiting for their L3 fetch."),
        "l3_queue_depth": (
            "l3_queue_depth",
            "L3 operations in the executors' queues (the worst rank of each replica).",
        ),
        "l2_blocks_resident": ("host_resident_blocks", "L2 host blocks holding a KV block."),
        "l2_blocks_active": (
            "host_active_blocks",
            "L2 host blocks referenced by a cache op in flight or a retraction image.",
        ),
    }

    def __init__(self, counter, gauge) -> None:
        self.preemptions = counter(
            "num_preemptions_total", "Requests retracted for KV capacity (imaged or recomputed)."
        )
        self.counters = {k: (counter(k, h), f) for k, (f, h) in self.COUNTERS.items()}
        self.gauges = {k: (gauge(k, h), f) for k, (f, h) in self.GAUGES.items()}

    def refresh(self, loads) -> None:
        self.preemptions.set(NO_LABELS, sum(x.num_preemptions for x in loads))
        caches = [x.cache for x in loads if x.cache is not None]
        if not caches:
            return
        for metric, name in (*self.counters.values(), *self.gauges.values()):
            metric.set(NO_LABELS, sum(getattr(c, name) for c in caches))


class SequenceStats:
    """Timing of one engine request, recorded into the histograms when it ends."""

    __slots__ = ("arrival", "first", "last", "metrics", "num_prompt_tokens", "num_tokens")

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last = self.arrival
        self.num_tokens = 0

    def on_output(self, out: RequestOutput) -> None:
        new = out.num_tokens - self.num_tokens
        if new <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.queue_time.observe(out.queue_seconds)
            self.metrics.prefix_queries.add(NO_LABELS, out.num_prompt_tokens)
            self.metrics.prefix_hits.add(NO_LABELS, out.num_cached_tokens)
        else:
            self.metrics.tpot.observe((now - self.last) / new)
        self.last = now
        self.num_tokens = out.num_tokens

    def finish(self, reason: str) -> None:
        m = self.metrics
        m.finished.inc({"finished_reason": reason})
        m.prompt_tokens.add(NO_LABELS, self.num_prompt_tokens)
        m.generation_tokens.add(NO_LABELS, self.num_tokens)
        if reason in ("stop", "length"):
            m.e2e.observe(time.monotonic() - self.arrival)
