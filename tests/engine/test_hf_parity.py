"""Greedy tokens from AsyncEngine equal transformers' generate() exactly, and the
chosen tokens' logprobs match within 1e-3 — under every scheduling configuration, and
from the L3 store: prompts a first engine served are answered by a fresh one from it."""

from __future__ import annotations

import pytest
from helpers.generation import final_outputs
from helpers.prompts import parity_prompts
from helpers.reference import hf_greedy

from tokenspeed_aio.sampling_params import SamplingParams

MAX_TOKENS = 12
PAGE = 4  # the start_engine fixture's page size

CONFIGS = {
    "prefix_cache": dict(enable_prefix_caching=True),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "chunked": dict(chunked_prefill_size=64),  # smaller than the longest prompt (301)
    # 79 usable blocks of 4 tokens hold the longest prompt with its outputs, but not
    # the first six requests' growth once they are resident: decodes retract.
    "retraction": dict(num_kv_blocks=80, chunked_prefill_size=512),
}


async def generate_all(engine, prompts, **params):
    sp = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0, **params
    )

    return await final_outputs(engine, prompts, sp)


def assert_matches_transformers(path, prompts, outs) -> None:
    for ids, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = hf_greedy(str(path), tuple(ids), MAX_TOKENS)
        assert out.token_ids == ref_tokens, f"prompt of {len(ids)} tokens"
        assert out.finish_reason == "length"
        got = [lp.logprob for lp in out.logprobs]
        assert got == pytest.approx(ref_logprobs, abs=1e-3)


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
async def test_greedy_matches_transformers(ckpt, start_engine, arch, config, depth):
    path = ckpt(arch)
    engine = await start_engine(path, in_flight_depth=depth, **CONFIGS[config])
    prompts = parity_prompts()
    assert_matches_transformers(path, prompts, await generate_all(engine, prompts))
    if config == "retraction":
        assert engine.control_loop.scheduler.num_retractions > 0


def l3_flags(backend: str, tmp_path, request) -> dict:
    if backend == "file":
        return dict(kvstore_storage_backend="file", kvstore_storage_dir=str(tmp_path / "l3"))
    master = request.getfixturevalue("mooncake_master")
    return dict(
        kvstore_storage_backend="mooncake",
        kvstore_mooncake_master=master.address,
        kvstore_mooncake_metadata_server=master.metadata_server,
        kvstore_mooncake_segment_gb=0.0625,
    )


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("backend", ["file", "mooncake"])
async def test_greedy_from_l3_matches_transformers(
    ckpt, start_engine, tmp_path, request, backend, depth
):
    """A first engine fills the store; a fresh one fetches every hash-complete page of the
    same prompts from it instead of computing it, and answers as transformers does."""
    path = ckpt("llama")
    flags = dict(in_flight_depth=depth, **l3_flags(backend, tmp_path, request))
    prompts = parity_prompts()
    first = await start_engine(path, **flags)
    assert_matches_transformers(path, prompts, await generate_all(first, prompts))
    await first.check_idle()  # every PUT settled
    assert first.control_loop.storage.stats.bytes.get("put", 0) > 0
    if backend == "file":  # the pages outlive the engine on disk; Mooncake's live in the
        await first.shutdown()  # segments its clients lend the store, so that one stays up
    fresh = await start_engine(path, **flags)
    outs = await generate_all(fresh, prompts)
    assert_matches_transformers(path, prompts, outs)
    pages = [(len(ids) - 1) // PAGE * PAGE for ids in prompts]
    assert [out.num_cached_tokens for out in outs] == pages
    assert fresh.control_loop.scheduler.storage.stats.fetched_tokens == sum(pages)


@pytest.mark.parametrize("arch", ["llama3", "mistral"])
async def test_other_llama_family_checkpoints(ckpt, start_engine, arch):
    path = ckpt(arch)
    engine = await start_engine(path)
    prompts = parity_prompts(seed=1)[:4]
    outs = await generate_all(engine, prompts)
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(str(path), tuple(ids), MAX_TOKENS)[0]


async def test_tied_embeddings(ckpt, start_engine):
    path = ckpt("qwen3", tie_word_embeddings=True)
    engine = await start_engine(path)
    prompts = parity_prompts(seed=2)[:4]
    outs = await generate_all(engine, prompts)
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(str(path), tuple(ids), MAX_TOKENS)[0]
