"""The operator's signals: the per-round batch line, the per-request line, async logging
through a bounded lossy queue, and OpenTelemetry request traces under a trace provider."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from helpers.generation import final_outputs

from tokenspeed_aio import AsyncEngine, EngineArgs
from tokenspeed_aio.api.tracing import register_trace_provider
from tokenspeed_aio.engine.async_logging import AsyncLogging
from tokenspeed_aio.sampling_params import SamplingParams

SMALL = dict(max_model_len=512, page_size=4, num_kv_blocks=256, max_num_seqs=8)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHARED = list(range(40, 56))  # four full blocks both prompts share


async def test_batch_and_request_lines(ckpt, start_engine, caplog):
    caplog.set_level(logging.INFO)
    engine = await start_engine(
        ckpt("llama"), log_batch_interval=2, log_request_stats=True, **SMALL
    )
    await final_outputs(engine, [SHARED + [7, 8]], PARAMS)
    await final_outputs(engine, [SHARED + [9, 10, 11]], PARAMS)  # a prefix hit
    batch = [r.getMessage() for r in caplog.records if r.name == "tokenspeed_aio.batch"]
    assert batch, "no batch line"
    for word in ("running", "waiting", "gen tok/s", "cache hit", "KV"):
        assert word in batch[0], batch[0]
    assert any("cache hit 0.0%" not in line for line in batch)  # the second prompt hit
    done = [r.getMessage() for r in caplog.records if r.name == "tokenspeed_aio.requests"]
    assert len(done) == 2
    assert "finished (length)" in done[1] and "output 6 tokens" in done[1]
    assert "(16 cached)" in done[1] and "ttft" in done[1]


class _Slow(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        time.sleep(0.01)  # a stream that cannot keep up
        self.messages.append(record.getMessage())


def test_async_logging_never_blocks_and_flushes_within_its_bound():
    root = logging.getLogger()
    slow = _Slow()
    saved = list(root.handlers)
    for h in saved:
        root.removeHandler(h)
    root.addHandler(slow)
    logs = AsyncLogging(capacity=20)
    logs.install()
    try:
        start = time.monotonic()
        for i in range(200):
            logging.getLogger("t").warning("record %d", i)
        assert time.monotonic() - start < 0.5  # 200 records x 10 ms would be 2 s
        assert logs.dropped > 0
        start = time.monotonic()
        logs.shutdown(timeout=0.3)
        assert time.monotonic() - start < 1.5  # bounded, whatever the stream does
        assert slow in root.handlers
        assert slow.messages[:3] == ["record 0", "record 1", "record 2"]  # in order
    finally:
        root.removeHandler(slow)
        for h in saved:
            root.addHandler(h)


TRACE_ID = 0x0123456789ABCDEF0123456789ABCDEF
PARENT = 0x00000000DEADBEEF


def _provider(rid: str):
    if rid.startswith("traced"):
        return (TRACE_ID, PARENT)
    if rid.startswith("bad"):
        return ("not an id", 5)  # invalid: native ids
    return None


async def test_request_spans_under_a_trace_provider(ckpt):
    pytest.importorskip("opentelemetry.sdk", reason="tracing needs opentelemetry-sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    register_trace_provider("test-provider", _provider)
    exporter = InMemorySpanExporter()
    args = EngineArgs(model=str(ckpt("llama")), trace_provider="test-provider", **SMALL)
    async with await AsyncEngine.start(args, trace_exporter=exporter) as engine:
        for rid in ("traced-1", "bad-1", "plain-1"):
            async for _ in engine.generate(
                prompt_token_ids=[5, 6, 7], sampling_params=PARAMS, rid=rid
            ):
                pass
        for _ in range(200):
            if len(exporter.get_finished_spans()) >= 15:
                break
            await asyncio.sleep(0.01)
    spans = exporter.get_finished_spans()
    roots = {s.attributes["request.id"]: s for s in spans if s.name == "request"}
    assert set(roots) == {"traced-1", "bad-1", "plain-1"}
    traced = roots["traced-1"]
    assert traced.context.trace_id == TRACE_ID and traced.parent.span_id == PARENT
    assert traced.attributes["request.output_tokens"] == 6
    children = [
        s for s in spans if s.parent is not None and s.parent.span_id == traced.context.span_id
    ]
    assert sorted(s.name for s in children) == ["decode", "finish", "prefill", "queue"]
    by_name = {s.name: s for s in children}
    assert by_name["queue"].end_time <= by_name["prefill"].start_time + 1
    assert by_name["prefill"].end_time <= by_name["decode"].start_time + 1
    for rid in ("bad-1", "plain-1"):  # native ids: a fresh trace, no parent
        assert roots[rid].context.trace_id != TRACE_ID and roots[rid].parent is None
