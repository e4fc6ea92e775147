"""FP8 through the whole engine on CPU: an FP8 checkpoint and online quantization give the
greedy tokens of their dequantized transformers reference, at overlap depth 0 and 1; an FP8
KV cache holds twice the tokens of a 16-bit one in the same memory, and its tokens do not
depend on the overlap depth. (The tiny test models' attention is too sharp for e4m3 keys to
keep their greedy tokens: bench/fp8_agreement.py measures that on a real model.)"""

from __future__ import annotations

import pytest
import torch
from helpers.fp8_checkpoints import fake_quant_reference, write_fp8_checkpoint
from helpers.generation import final_outputs
from helpers.prompts import parity_prompts

from tokenspeed_aio.sampling_params import SamplingParams

MAX_TOKENS = 10


def _greedy(model, ids):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


async def _tokens(engine, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in await final_outputs(engine, prompts, params)]


@pytest.fixture(scope="module")
def ct_channel(tmp_path_factory):
    from helpers.checkpoints import make_checkpoint

    src = make_checkpoint(tmp_path_factory.mktemp("bf16"), "llama3")
    return src, write_fp8_checkpoint(src, tmp_path_factory.mktemp("fp8"), "ct-channel", kv=True)


@pytest.mark.parametrize("depth", [0, 1])
async def test_fp8_checkpoint_greedy_equals_its_reference(ct_channel, start_engine, depth):
    _, path = ct_channel
    engine = await start_engine(path, in_flight_depth=depth)
    prompts = parity_prompts()[:5]
    reference = fake_quant_reference(path, "ct-channel")
    assert await _tokens(engine, prompts) == [_greedy(reference, ids) for ids in prompts]


async def test_online_fp8_greedy_equals_its_reference(ct_channel, start_engine):
    src, _ = ct_channel
    engine = await start_engine(src, quantization="fp8")
    prompts = parity_prompts(seed=3)[:5]
    reference = fake_quant_reference(src)
    assert await _tokens(engine, prompts) == [_greedy(reference, ids) for ids in prompts]


async def test_fp8_kv_cache_doubles_the_pool(ct_channel, start_engine):
    _, path = ct_channel
    budget = dict(num_kv_blocks=None, kv_cache_memory_gb=0.001, max_num_seqs=64)
    bf16 = await start_engine(path, dtype="bfloat16", **budget)
    fp8 = await start_engine(path, dtype="bfloat16", kv_cache_dtype="fp8", **budget)
    bf16_blocks, fp8_blocks = (e.control_loop.scheduler.pool.num_blocks for e in (bf16, fp8))
    assert fp8_blocks // 2 == bf16_blocks  # the same bytes hold twice the blocks


async def test_fp8_kv_cache_tokens_do_not_depend_on_overlap(ct_channel, start_engine):
    _, path = ct_channel
    prompts = parity_prompts(seed=4)[:6]
    tokens = []
    for depth in (0, 1):
        engine = await start_engine(path, kv_cache_dtype="fp8", in_flight_depth=depth)
        tokens.append(await _tokens(engine, prompts))
    assert tokens[0] == tokens[1]
