"""Request lifecycle through AsyncEngine: prefix reuse, cancellation, identity rules,
stop conditions, logprobs."""

from __future__ import annotations

import asyncio

import pytest
from helpers.prompts import parity_prompts
from helpers.reference import hf_greedy, hf_prompt_logprobs

from tokenspeed_aio.errors import InvalidRequestError, RequestConflictError
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.wire.messages import GenerateRequest

GREEDY = dict(temperature=0.0, ignore_eos=True)


async def final(engine, ids=None, prompt=None, **params):
    last = None
    async for out in engine.generate(
        prompt, SamplingParams(**{**GREEDY, **params}), prompt_token_ids=ids
    ):
        last = out
    return last


async def test_shared_prefix_reuses_cached_blocks(ckpt, start_engine):
    path = ckpt("llama")
    engine = await start_engine(path, page_size=4)
    shared = parity_prompts()[6][:120]  # 30 full blocks
    first = await final(engine, shared + [7, 8, 9], max_tokens=4)
    assert first.num_cached_tokens == 0
    second = await final(engine, shared + [11, 12], max_tokens=8)
    assert second.num_cached_tokens == 120
    assert second.token_ids == hf_greedy(str(path), tuple(shared + [11, 12]), 8)[0]


async def test_cancelling_the_consumer_aborts_and_frees_blocks(ckpt, start_engine):
    engine = await start_engine(ckpt("llama"))
    seen = asyncio.Event()

    async def consume():
        async for _ in engine.generate(
            prompt_token_ids=parity_prompts()[5],
            sampling_params=SamplingParams(max_tokens=500, **GREEDY),
        ):
            seen.set()

    task = asyncio.create_task(consume())
    await seen.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.check_idle()  # blocks back, no request state anywhere
    assert engine.control_loop.scheduler.pool.num_active == 0


async def test_concurrent_requests_share_batches(ckpt, start_engine):
    path = ckpt("llama")
    engine = await start_engine(path)
    prompts = parity_prompts(seed=4)
    outs = await asyncio.gather(*(final(engine, p, max_tokens=6) for p in prompts))
    rows = [s.running for s in engine.control_loop.stats.samples]
    assert max(rows) >= 4, "requests were meant to run in one batch"
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(str(path), tuple(p), 6)[0]


async def test_stop_token_ids_and_eos(ckpt, start_engine):
    path = ckpt("llama")
    engine = await start_engine(path)
    prompt = parity_prompts()[3]
    ref = hf_greedy(str(path), tuple(prompt), 12)[0]
    stop = ref[5]
    out = await final(engine, prompt, max_tokens=12, stop_token_ids=[stop])
    cut = ref.index(stop) + 1
    assert out.token_ids == ref[:cut] and out.finish_reason == "stop"
    assert out.stop_reason == stop
    # min_tokens bans the stop token until enough tokens were generated.
    out = await final(engine, prompt, max_tokens=12, stop_token_ids=[stop], min_tokens=cut + 1)
    assert out.finish_reason in ("stop", "length") and len(out.token_ids) > cut


async def test_stop_strings_truncate_text_and_end_the_request(ckpt, start_engine):
    path = ckpt("llama")
    engine = await start_engine(path)
    prompt = "The for statement"
    full = await final(engine, prompt=prompt, max_tokens=16)
    stop = full.text[6:9]
    assert stop, full.text
    out = await final(engine, prompt=prompt, max_tokens=16, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    kept = await final(
        engine, prompt=prompt, max_tokens=16, stop=[stop], include_stop_str_in_output=True
    )
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


async def test_streamed_deltas_add_up_to_the_text(ckpt, start_engine):
    engine = await start_engine(ckpt("llama"))
    deltas, last = [], None
    async for out in engine.generate(
        "def f(x):", SamplingParams(max_tokens=20, stop=["zz"], **GREEDY)
    ):
        deltas.append(out.delta_text)
        last = out
    assert "".join(deltas) == last.text
    assert last.text == engine.tokenizer.decode(last.token_ids)


async def test_top_logprobs_and_prompt_logprobs(ckpt, start_engine):
    path = ckpt("qwen3")
    engine = await start_engine(path)
    prompt = parity_prompts()[2]
    out = await final(engine, prompt, max_tokens=5, logprobs=3, prompt_logprobs=2)
    ref_tokens, ref_lps = hf_greedy(str(path), tuple(prompt), 5)
    assert out.token_ids == ref_tokens
    for tok, lp, ref in zip(out.token_ids, out.logprobs, ref_lps):
        assert lp.logprob == pytest.approx(ref, abs=1e-3)
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the top-1 is the token
    plps = out.prompt_logprobs
    assert plps[0] is None and len(plps) == len(prompt)
    ref_plps = hf_prompt_logprobs(str(path), prompt)
    assert [p.logprob for p in plps[1:]] == pytest.approx(ref_plps, abs=1e-3)
    assert all(len(p.top) == 2 for p in plps[1:])


async def test_prompt_logprobs_across_chunks(ckpt, start_engine):
    path = ckpt("llama")
    engine = await start_engine(path, chunked_prefill_size=16)
    prompt = parity_prompts()[4]  # 64 tokens: 4 chunks
    out = await final(engine, prompt, max_tokens=2, prompt_logprobs=0)
    ref = hf_prompt_logprobs(str(path), prompt)
    assert [p.logprob for p in out.prompt_logprobs[1:]] == pytest.approx(ref, abs=1e-3)


async def test_seeded_sampling_is_batch_independent(ckpt, start_engine):
    engine = await start_engine(ckpt("llama"))
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=1234)

    async def run(ids, p):
        last = None
        async for out in engine.generate(prompt_token_ids=ids, sampling_params=p):
            last = out
        return last

    alone = await run(parity_prompts()[3], params)
    noise = [
        run(p, SamplingParams(max_tokens=10, temperature=1.0, seed=i))
        for i, p in enumerate(parity_prompts(seed=9))
    ]
    together, *_ = await asyncio.gather(run(parity_prompts()[3], params), *noise)
    assert together.token_ids == alone.token_ids
    other = await run(parity_prompts()[3], SamplingParams(max_tokens=10, temperature=0.8, seed=99))
    assert other.token_ids != alone.token_ids


async def test_repetition_penalty_matches_transformers(ckpt, start_engine):
    path = ckpt("llama")
    engine = await start_engine(path)
    prompt = parity_prompts()[3]
    out = await final(engine, prompt, max_tokens=12, repetition_penalty=1.3)
    ref = hf_greedy(str(path), tuple(prompt), 12, repetition_penalty=1.3)[0]
    assert out.token_ids == ref


async def test_bad_requests_are_refused_and_the_engine_keeps_serving(ckpt, start_engine):
    engine = await start_engine(ckpt("llama"), max_model_len=64)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        await final(engine, list(range(5, 60)), max_tokens=10)
    with pytest.raises(InvalidRequestError, match="empty"):
        await final(engine, [], max_tokens=1)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        await final(engine, [5, 100000], max_tokens=1)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=1.5)
    out = await final(engine, [5, 6, 7], max_tokens=3)
    assert out.finished and len(out.token_ids) == 3


async def test_duplicate_rid_is_refused_by_the_frontend(ckpt, start_engine):
    engine = await start_engine(ckpt("llama"))
    gen = engine.generate(
        prompt_token_ids=[5, 6], sampling_params=SamplingParams(max_tokens=50, **GREEDY), rid="dup"
    )
    await gen.__anext__()
    with pytest.raises(RequestConflictError):
        await final_rid(engine, "dup")
    await gen.aclose()


async def final_rid(engine, rid):
    async for _ in engine.generate(
        prompt_token_ids=[5], sampling_params=SamplingParams(max_tokens=1), rid=rid
    ):
        pass


class ManualRounds:
    """An engine rank whose rounds the test runs one at a time, over the in-process wire."""

    def __init__(self, rank, transport):
        self.rank, self.transport, self.loop = rank, transport, rank.loop
        self.outputs = []

    async def round(self):
        await self.loop.round()
        while not self.transport.outputs.empty():
            self.outputs.extend(self.transport.outputs.get_nowait().outputs)

    def submit(self, rid, ids=(5, 6, 7), max_tokens=4, **kw):
        params = SamplingParams(max_tokens=max_tokens, **GREEDY, **kw)
        self.transport.put(GenerateRequest(rid, list(ids), params, 0))

    def finals(self, rid):
        return [o for o in self.outputs if o.rid == rid and o.finished]

    def tokens(self, rid):
        return [t for o in self.outputs if o.rid == rid for t in o.token_ids]

    async def until_idle(self):
        await self.round()  # receives what was submitted
        while not self.loop.idle():
            await self.round()


@pytest.fixture
async def manual(ckpt):
    from tokenspeed_aio.args import EngineArgs
    from tokenspeed_aio.control.transport import LocalTransport
    from tokenspeed_aio.engine.rank import EngineRank

    transport = LocalTransport()
    args = EngineArgs(model=str(ckpt("llama")), num_kv_blocks=64, page_size=4, in_flight_depth=1)
    rank = await EngineRank.start(args, transport)
    yield ManualRounds(rank, transport)
    rank.loop.check_idle()
    await rank.data_plane.shutdown()


async def test_duplicate_rids_are_discarded_and_the_original_untouched(manual, caplog):
    manual.submit("a", max_tokens=30)
    manual.submit("a", max_tokens=2)  # repeated in the same round
    await manual.round()
    manual.submit("a", max_tokens=2)  # still owned by the output processor
    await manual.round()
    await manual.until_idle()
    assert [o.finish_reason for o in manual.finals("a")] == ["length"]
    assert len(manual.tokens("a")) == 30
    assert sum("duplicate submission" in r.message for r in caplog.records) == 2


async def test_rid_held_by_the_scheduler_gets_409_until_released(manual):
    manual.submit("probe", max_tokens=8)
    await manual.until_idle()
    probe = manual.tokens("probe")
    i = next(i for i in range(1, 8) if probe[i] not in probe[:i])
    # Ends on a stop token: at depth 1 its next forward is already in flight.
    manual.submit("b", max_tokens=8, stop_token_ids=[probe[i]])
    while not manual.finals("b"):
        await manual.round()
    assert manual.loop.scheduler.holds("b") and not manual.loop.output.owns("b")
    manual.submit("b", max_tokens=2)
    await manual.round()
    refusal = manual.finals("b")[-1]
    assert refusal.error_status == 409 and "still held" in refusal.error_message
    await manual.until_idle()
    manual.submit("b", max_tokens=2)  # both owners released it: usable again
    await manual.until_idle()
    assert manual.finals("b")[-1].finish_reason == "length"


async def test_rejected_submission_batch_fails_its_requests_only(ckpt, start_engine):
    engine = await start_engine(ckpt("llama"), num_kv_blocks=9)  # 8 blocks = 32 tokens
    running = engine.frontend.submit("run", [5, 6], SamplingParams(max_tokens=20, **GREEDY))
    await running.queue.get()  # running before the bad batch arrives
    big = engine.frontend.submit("big", list(range(5, 45)), SamplingParams(max_tokens=1, **GREEDY))
    mate = engine.frontend.submit("mate", [5, 6], SamplingParams(max_tokens=1, **GREEDY))
    for stream in (big, mate):  # one submission batch: both get its error
        item = await stream.queue.get()
        assert isinstance(item, InvalidRequestError) and "KV blocks" in str(item)
    while not (out := await running.queue.get()).finished:
        pass
    assert len(out.token_ids) == 20
    engine.frontend.streams.clear()
