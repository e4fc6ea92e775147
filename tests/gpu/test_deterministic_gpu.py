"""--enable-deterministic-inference on CUDA: the tiny model in bfloat16 (the skinny_gemm
tile path, the Triton attention backend, CUDA graphs) gives the same token ids and
logprobs alone, in batches, after prefix hits and with small prefill chunks."""

from __future__ import annotations

import pytest
from helpers.determinism import TARGETS, alone, batched, run

ENGINE = dict(device="cuda", dtype="bfloat16", page_size=16, num_kv_blocks=2048,
              max_num_seqs=64, max_model_len=512)  # fmt: skip


@pytest.mark.timeout(900)
async def test_results_do_not_depend_on_the_batch_on_gpu(ckpt, start_engine):
    path = ckpt("llama")
    engine = await start_engine(path, enable_deterministic_inference=True, **ENGINE)
    reference = await alone(engine)
    for size in (2, 8, 64):
        assert await batched(engine, size) == reference, f"batch of {size}"
    assert await run(engine, TARGETS) == reference, "prefix hits"
    chunked = await start_engine(
        path, enable_deterministic_inference=True, chunked_prefill_size=16, **ENGINE
    )
    assert await batched(chunked, 16) == reference, "prefill chunks of 16 tokens"
