"""Driving an engine from tests: every request's final output."""

from __future__ import annotations

import asyncio

from tokenspeed_aio.sampling_params import SamplingParams


async def final_output(engine, params: SamplingParams, ids: list[int] | None = None, prompt=None):
    last = None
    kw = {"prompt_token_ids": ids} if ids is not None else {"prompt": prompt}
    async for out in engine.generate(sampling_params=params, **kw):
        last = out
    return last


async def final_outputs(engine, prompts: list[list[int]], params: SamplingParams) -> list:
    """The final outputs of token-id prompts submitted concurrently."""
    return await asyncio.gather(*(final_output(engine, params, ids) for ids in prompts))
