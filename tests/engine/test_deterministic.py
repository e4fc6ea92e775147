"""--enable-deterministic-inference: the same 32 greedy requests give identical token ids
and logprobs, to the last bit, alone, in batches of 2 to 64, after prefix hits, and with
their prompts split into prefill chunks. Without the mode they do not (the check that
the test can fail: CPU BLAS orders a row's sums by the batch's shape)."""

from __future__ import annotations

import pytest
from helpers.determinism import alone, batched, check_batch_invariance

ENGINE = dict(page_size=4, num_kv_blocks=2048, max_num_seqs=64, max_model_len=512)


@pytest.mark.timeout(900)
async def test_results_do_not_depend_on_the_batch(ckpt, start_engine):
    await check_batch_invariance(ckpt("llama"), start_engine, ENGINE)


async def test_without_the_mode_a_batch_changes_some_result(ckpt, start_engine):
    engine = await start_engine(ckpt("llama"), **ENGINE)
    reference = await alone(engine)
    changed = [a != b for a, b in zip(reference, await batched(engine, 64))]
    assert any(changed), "batch-invariance held without the mode: this test cannot fail"
