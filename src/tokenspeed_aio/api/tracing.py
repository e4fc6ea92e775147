"""Request traces with OpenTelemetry (``--enable-trace``; the ``opentelemetry-sdk`` package).

The frontend records each finished request's timeline -- arrival, the rank's queue time,
first token, end -- into a bounded, lossy queue (a full queue drops the trace and counts
it); an export thread turns it into spans: ``request`` and, under it, ``queue``,
``prefill``, ``decode`` and ``finish``. No span work runs on the event loop.

A plugin maps request ids to trace context: ``register_trace_provider(name, provider)``,
selected by ``--trace-provider NAME``. ``provider(rid)`` returns ``(trace_id,
parent_span_id)`` (ints; the parent may be None) or None. It runs only on the export
thread and must be short and non-blocking: no I/O, no device. A missing or invalid answer
keeps the native (random) ids; sampling and the spans' lifecycle are unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

TraceContext = tuple[int, int | None]
TraceProvider = Callable[[str], TraceContext | None]
_PROVIDERS: dict[str, TraceProvider] = {}


def register_trace_provider(name: str, provider: TraceProvider) -> None:
    """Make ``provider`` selectable as ``--trace-provider name``."""
    _PROVIDERS[name] = provider


def trace_provider(name: str) -> TraceProvider:
    if name not in _PROVIDERS:
        known = ", ".join(sorted(_PROVIDERS)) or "none registered"
        raise ValueError(f"trace_provider: no provider {name!r} ({known})")
    return _PROVIDERS[name]


@dataclass(frozen=True, slots=True)
class RequestTimeline:
    """Wall-clock seconds (time.time()) of one request's life, as the frontend saw it."""

    rid: str
    arrival: float
    queue_seconds: float  # the rank's: scheduler submission to first forward
    first_token: float | None
    end: float
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    weight_version: str


def _valid(context: object) -> bool:
    if not isinstance(context, tuple) or len(context) != 2:
        return False
    trace_id, parent = context
    return (
        isinstance(trace_id, int)
        and 0 < trace_id < 2**128
        and (parent is None or (isinstance(parent, int) and 0 < parent < 2**64))
    )


class RequestTracer:
    def __init__(
        self,
        *,
        provider: TraceProvider | None = None,
        exporter=None,
        otlp_endpoint: str | None = None,
        capacity: int = 10_000,
        service_name: str = "tokenspeed_aio",
    ) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        if exporter is None:
            exporter = _otlp_exporter(otlp_endpoint) if otlp_endpoint else _LogExporter()
            processor = BatchSpanProcessor(exporter)
        else:
            processor = SimpleSpanProcessor(exporter)  # a test's exporter sees spans at once
        self._tracer_provider = TracerProvider(
            resource=Resource.create({"service.name": service_name})
        )
        self._tracer_provider.add_span_processor(processor)
        self._tracer = self._tracer_provider.get_tracer("tokenspeed_aio")
        self.provider = provider
        self.dropped = 0
        self.exported = 0
        self._queue: queue.Queue[RequestTimeline | None] = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._export_main, name="ts-trace", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, args) -> RequestTracer | None:
        if not (args.enable_trace or args.trace_provider or args.otlp_traces_endpoint):
            return None
        provider = trace_provider(args.trace_provider) if args.trace_provider else None
        return cls(provider=provider, otlp_endpoint=args.otlp_traces_endpoint)

    def record(self, timeline: RequestTimeline) -> None:
        """From the event loop: never blocks (a full queue drops the trace)."""
        try:
            self._queue.put_nowait(timeline)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._tracer_provider.shutdown()

    # -- the export thread ----------------------------------------------------------
    def _export_main(self) -> None:
        while (timeline := self._queue.get()) is not None:
            try:
                self._export(timeline)
                self.exported += 1
            except Exception:
                logger.exception("exporting the trace of %s failed", timeline.rid)

    def _context(self, rid: str):
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

        if self.provider is None:
            return None
        try:
            context = self.provider(rid)
        except Exception:
            logger.exception("trace provider failed for %s", rid)
            return None
        if not _valid(context):
            return None  # missing or invalid: the native ids stay
        trace_id, parent = context
        span = SpanContext(
            trace_id=trace_id,
            span_id=parent or (trace_id & (2**64 - 1)) or 1,
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
        return trace.set_span_in_context(NonRecordingSpan(span))

    def _export(self, t: RequestTimeline) -> None:
        from opentelemetry import trace

        ns = 1_000_000_000

        def at(seconds: float) -> int:
            return int(seconds * ns)

        root = self._tracer.start_span(
            "request",
            context=self._context(t.rid),
            start_time=at(t.arrival),
            attributes={
                "request.id": t.rid,
                "request.prompt_tokens": t.prompt_tokens,
                "request.cached_tokens": t.cached_tokens,
                "request.output_tokens": t.output_tokens,
                "request.finish_reason": t.finish_reason,
                "request.weight_version": t.weight_version,
            },
        )
        under = trace.set_span_in_context(root)
        queued = min(t.arrival + t.queue_seconds, t.first_token or t.end)
        first = t.first_token or t.end
        for name, start, end in (
            ("queue", t.arrival, queued),
            ("prefill", queued, first),
            ("decode", first, t.end),
            ("finish", t.end, t.end),
        ):
            span = self._tracer.start_span(name, context=under, start_time=at(start))
            span.end(end_time=at(max(end, start)))
        root.end(end_time=at(t.end))


class _LogExporter:
    """Without an OTLP endpoint: each span as a debug log line."""

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        for span in spans:
            logger.debug(
                "span %s trace=%032x %.3f ms", span.name, span.context.trace_id,
                (span.end_time - span.start_time) / 1e6,
            )  # fmt: skip
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing to release: each span went to the log as it ended."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _otlp_exporter(endpoint: str):
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(
                "otlp_traces_endpoint: install opentelemetry-exporter-otlp to export over OTLP"
            ) from None
    return OTLPSpanExporter(endpoint=endpoint)
