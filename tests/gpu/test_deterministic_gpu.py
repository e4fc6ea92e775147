"""--enable-deterministic-inference on CUDA: the tiny model in bfloat16 (the skinny_gemm
tile path, the Triton attention backend, CUDA graphs) gives the same token ids and
logprobs alone, in batches, after prefix hits and with small prefill chunks."""

from __future__ import annotations

import pytest
from helpers.determinism import check_batch_invariance

ENGINE = dict(device="cuda", dtype="bfloat16", page_size=16, num_kv_blocks=2048,
              max_num_seqs=64, max_model_len=512)  # fmt: skip


@pytest.mark.timeout(900)
async def test_results_do_not_depend_on_the_batch_on_gpu(ckpt, start_engine):
    await check_batch_invariance(ckpt("llama"), start_engine, ENGINE)
