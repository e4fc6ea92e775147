"""pause_generation's three modes with requests in flight and arriving: keep freezes and
answers at once, wait lets what runs finish, abort ends it; admission is held in every
mode and the held requests are served after continue. Nothing is lost (every stream ends,
with the tokens transformers gives) and no block leaks (the fixture's leak check)."""

from __future__ import annotations

import asyncio

import pytest
from helpers.reference import hf_greedy

from tokenspeed_aio.api.control import EngineControlError
from tokenspeed_aio.sampling_params import SamplingParams

SMALL = dict(max_model_len=1024, page_size=4, num_kv_blocks=512, max_num_seqs=8)
LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [11, 12, 13, 14, 15], "b": [21, 22, 23], "c": [31, 32, 33, 34]}
PROMPTS["d"] = PROMPTS["a"] + [41, 42, 43]  # shares a's first block


async def running(engine, rid: str, params: SamplingParams = LONG, tokens: int = 2):
    """Submit ``rid`` and wait until it produced ``tokens`` tokens."""
    stream = engine.frontend.submit(rid, PROMPTS[rid], params)
    while len(stream.token_ids) < tokens:
        await asyncio.sleep(0.005)
    return stream


async def final(stream):
    out = None
    while out is None or not out.finished:
        out = await stream.queue.get()
    return out


def expected(path, rid: str, params: SamplingParams) -> list[int]:
    return hf_greedy(str(path), tuple(PROMPTS[rid]), params.max_tokens)[0]


async def test_keep_freezes_at_once_and_continue_resumes(ckpt, start_engine):
    path = ckpt("llama")
    engine = await start_engine(path, **SMALL)
    a, b = await running(engine, "a"), await running(engine, "b")
    await engine.pause_generation("keep")  # answered at once, while a and b run
    frozen = (len(a.token_ids), len(b.token_ids))
    assert frozen[0] < LONG.max_tokens and frozen[1] < LONG.max_tokens
    c = engine.frontend.submit("c", PROMPTS["c"], SHORT)  # arrives while frozen
    await asyncio.sleep(0.3)
    assert (len(a.token_ids), len(b.token_ids)) == frozen  # no forward ran
    assert c.token_ids == []
    with pytest.raises(EngineControlError) as refused:  # its drain would run the frozen ones
        await engine.release_memory_occupation(["kv_cache"])
    assert refused.value.status == 409 and "keep pause" in refused.value.message
    await engine.continue_generation()
    outs = {rid: await final(s) for rid, s in (("a", a), ("b", b), ("c", c))}
    for rid, params in (("a", LONG), ("b", LONG), ("c", SHORT)):
        assert outs[rid].finish_reason == "length"
        assert outs[rid].token_ids == expected(path, rid, params)


async def test_wait_lets_running_requests_finish_and_holds_new_ones(ckpt, start_engine):
    path = ckpt("llama")
    engine = await start_engine(path, **SMALL)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    a = await running(engine, "a", params)
    pause = asyncio.create_task(engine.pause_generation("wait"))
    await asyncio.sleep(0.02)
    c = engine.frontend.submit("c", PROMPTS["c"], SHORT)  # arrives while draining
    await pause  # answered once drained: a ran to its end
    assert a.finished and len(a.token_ids) == 60
    assert a.token_ids == expected(path, "a", params)
    await asyncio.sleep(0.2)
    assert c.token_ids == [] and not c.finished
    await engine.continue_generation()
    assert (await final(c)).token_ids == expected(path, "c", SHORT)


async def test_abort_ends_running_requests_and_serves_held_ones(ckpt, start_engine):
    path = ckpt("llama")
    engine = await start_engine(path, **SMALL)
    a, b = await running(engine, "a"), await running(engine, "b")
    await engine.pause_generation("abort")  # answered once drained
    for stream in (a, b):
        out = await final(stream)
        assert out.finish_reason == "abort" and len(out.token_ids) < LONG.max_tokens
        prefix = expected(ckpt("llama"), stream.rid, LONG)[: len(out.token_ids)]
        assert out.token_ids == prefix  # what it got before the abort was right
    c = engine.frontend.submit("c", PROMPTS["c"], SHORT)  # arrives while paused
    await asyncio.sleep(0.2)
    assert c.token_ids == []
    with pytest.raises(EngineControlError) as refused:
        await engine.pause_generation("sideways")
    assert refused.value.status == 400 and "mode" in refused.value.message
    await engine.continue_generation()
    assert (await final(c)).token_ids == expected(path, "c", SHORT)


async def test_release_drains_like_wait_and_a_pause_under_it_is_refused(ckpt, start_engine):
    path = ckpt("llama")
    engine = await start_engine(path, **SMALL)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    a = await running(engine, "a", params)
    await engine.release_memory_occupation(["kv_cache"])  # after a finished
    assert a.finished and a.token_ids == expected(path, "a", params)
    d = engine.frontend.submit("d", PROMPTS["d"], SHORT)  # held while released
    with pytest.raises(EngineControlError) as refused:
        await engine.pause_generation("wait")
    assert refused.value.status == 409 and "released" in refused.value.message
    with pytest.raises(EngineControlError) as again:
        await engine.release_memory_occupation(["kv_cache"])
    assert again.value.status == 409
    await asyncio.sleep(0.2)
    assert d.token_ids == []
    await engine.resume_memory_occupation()  # every released region
    out = await final(d)
    assert out.token_ids == expected(path, "d", SHORT)
    assert out.num_cached_tokens == 0  # a's cached block went with the KV release
