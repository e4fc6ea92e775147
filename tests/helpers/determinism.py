"""The deterministic-inference checks' requests: 32 greedy targets (3 to 90 prompt
tokens), fillers to make up a batch, and the ways of running them."""

from __future__ import annotations

import asyncio
import random

from tokenspeed_aio.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(rng.randrange(3, 90))] for _ in range(count)]


TARGETS = prompts(32, seed=1)
FILLERS = prompts(32, seed=2)


async def run(engine, batch: list[list[int]]) -> list[tuple]:
    """Each prompt's (token ids, logprobs, top alternatives), all submitted at once."""

    async def one(ids):
        last = None
        async for out in engine.generate(prompt_token_ids=ids, sampling_params=PARAMS):
            last = out
        return (
            tuple(last.token_ids),
            tuple(lp.logprob for lp in last.logprobs),
            tuple(tuple(lp.top) for lp in last.logprobs),
        )

    return list(await asyncio.gather(*(one(ids) for ids in batch)))


async def alone(engine) -> list[tuple]:
    return [(await run(engine, [ids]))[0] for ids in TARGETS]


async def batched(engine, size: int) -> list[tuple]:
    """The targets in batches of ``size`` (fillers complete a batch larger than 32)."""
    pool = TARGETS + FILLERS[: max(0, size - len(TARGETS))]
    results = []
    for start in range(0, len(TARGETS), size):
        results += (await run(engine, pool[start : start + size]))[: len(TARGETS) - start]
    return results


async def check_batch_invariance(path, start_engine, engine_args: dict) -> None:
    """The targets alone are the reference; in batches of 2, 8 and 64, again with their
    prompts in the prefix cache, and on an engine with 16-token prefill chunks, every
    token id and logprob must equal it."""
    engine = await start_engine(path, enable_deterministic_inference=True, **engine_args)
    reference = await alone(engine)
    for size in (2, 8, 64):
        assert await batched(engine, size) == reference, f"batch of {size}"
    # Prefix hits: the targets again, their prompts (all but the last block) now cached.
    assert await run(engine, TARGETS) == reference, "prefix hits"
    chunked = await start_engine(
        path, enable_deterministic_inference=True, chunked_prefill_size=16, **engine_args
    )
    assert await batched(chunked, 16) == reference, "prefill chunks of 16 tokens"
