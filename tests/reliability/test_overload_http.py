"""Overload: far more concurrent requests than the KV pool holds. Every request
completes (waiting, retracted and recomputed as the pool runs out), and every greedy
output equals the same prompt's output on an unloaded server; the active KV blocks
never exceed the pool and return to zero."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from reliability.harness import GREEDY, run_server

PAGE = 4
USABLE_BLOCKS = 32  # 128 tokens of KV cache
MAX_TOKENS = 16
PROMPTS = 32  # each grows to 32..40 tokens (8..10 blocks): ~3 fit, 32 are sent at once


@pytest.fixture(scope="module")
def server(reliability_checkpoint, tmp_path_factory):
    with run_server(
        reliability_checkpoint,
        tmp_path_factory.mktemp("logs"),
        page_size=PAGE,
        num_kv_blocks=USABLE_BLOCKS + 1,
        max_model_len=128,
    ) as s:
        yield s


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(16, 24))] for _ in range(PROMPTS)]


async def complete(c, prompt: list[int], stream: bool) -> tuple[list[int], str]:
    body = {"input_ids": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": MAX_TOKENS, **GREEDY}}  # fmt: skip
    if not stream:
        r = await c.post("/generate", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["output_ids"], out["meta_info"]["finish_reason"]["type"]
    last = None
    async with c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
                assert "error" not in last, last
    return last["output_ids"], last["meta_info"]["finish_reason"]["type"]


async def test_4x_more_requests_than_the_pool_holds_all_complete_with_unloaded_outputs(server):
    ps = prompts()
    need = [-(-(len(p) + MAX_TOKENS) // PAGE) for p in ps]
    assert sum(need) >= 4 * USABLE_BLOCKS, "the load must be at least 4x the pool"
    async with server.client(timeout=300) as c:
        unloaded = [await complete(c, p, stream=False) for p in ps]
        await server.wait_idle()
        peak = {"waiting": 0.0, "running": 0.0, "active": 0.0}
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                m = await server.metrics()
                for key, name in (("waiting", "num_requests_waiting"),
                                  ("running", "num_requests_running"),
                                  ("active", "kv_blocks_active")):  # fmt: skip
                    peak[key] = max(peak[key], m[f"tokenspeed:{name}"])
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        loaded = await asyncio.gather(*(complete(c, p, i % 2 == 0) for i, p in enumerate(ps)))
        done.set()
        await watcher
        idle = await server.wait_idle()
    print(f"reliability: overload requests={len(ps)} blocks_needed={sum(need)} "
          f"pool={USABLE_BLOCKS} peak={peak}")  # fmt: skip
    assert all(reason == "length" for _, reason in unloaded)
    for i, (got, want) in enumerate(zip(loaded, unloaded)):
        assert got == want, f"prompt {i}: loaded {got} != unloaded {want}"
    assert peak["waiting"] > 0, "the pool was meant to overflow"
    assert peak["active"] <= USABLE_BLOCKS
    assert idle["tokenspeed:kv_blocks_total"] == USABLE_BLOCKS
