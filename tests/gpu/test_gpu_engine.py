"""The engine on a GPU: exact against transformers in fp32, overlap equals no overlap,
and the data plane's rules hold (no host sync, no JIT compile while serving)."""

from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import replace

import pytest
from helpers.generation import final_output, final_outputs
from helpers.prompts import parity_prompts

from tokenspeed_aio.api.engine import AsyncEngine
from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)


async def run_all(engine, prompts, params=GREEDY):
    return await final_outputs(engine, prompts, params)


@pytest.fixture(autouse=True)
def strict_data_plane(monkeypatch):
    monkeypatch.setenv("TOKENSPEED_DATA_PLANE_SYNC_DEBUG", "error")
    monkeypatch.setenv("TOKENSPEED_JIT_COMPILE_CHECK", "error")


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
async def test_tiny_model_matches_transformers_on_gpu(ckpt, arch, depth):
    import torch
    import transformers

    path = ckpt(arch)
    args = EngineArgs(
        model=str(path), device="cuda", dtype="float32", max_model_len=1024, in_flight_depth=depth
    )
    prompts = parity_prompts()
    async with await AsyncEngine.start(args) as engine:
        outs = await run_all(engine, prompts)
        assert torch.cuda.get_sync_debug_mode() == 2  # armed when serving began
        await engine.check_idle()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    for ids, out in zip(prompts, outs):
        ref = model.generate(
            torch.tensor([ids], device="cuda"),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
        assert out.token_ids == ref, f"prompt of {len(ids)} tokens"


needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="the optional flashinfer package is not installed",
)


@pytest.mark.parametrize("backend", ["triton", pytest.param("flashinfer", marks=needs_flashinfer)])
async def test_overlap_matches_no_overlap_on_an_8b_shape(tmp_path, backend):
    from tokenspeed_aio.bench.shapes import checkpoint_dir

    path = checkpoint_dir("llama-8b", tmp_path)
    prompts = parity_prompts(vocab=128000, seed=3)
    tokens = {}
    for depth in (0, 1):
        args = EngineArgs(
            model=str(path),
            load_format="dummy",
            dtype="bfloat16",
            in_flight_depth=depth,
            max_model_len=4096,
            max_num_seqs=64,
            gpu_memory_utilization=0.85,
            attention_backend=backend,
        )
        async with await AsyncEngine.start(args) as engine:
            outs = await run_all(engine, prompts)
            tokens[depth] = [o.token_ids for o in outs]
            await engine.check_idle()
    assert tokens[0] == tokens[1]


@needs_flashinfer
async def test_flashinfer_greedy_agrees_with_the_triton_backend(ckpt):
    # FlashInfer has 16-bit kernels only, so no exact fp32 comparison with transformers: its
    # greedy sequences (decode from CUDA graphs, overlap on) are scored teacher-forced by the
    # Triton backend's prefill instead. Each token's logprob must agree within fp16 noise,
    # and each chosen token must be Triton's argmax or within that noise of it. head_dim 128.
    path = ckpt("llama", hidden_size=256, num_attention_heads=2, num_key_value_heads=1)
    args = EngineArgs(
        model=str(path), device="cuda", dtype="float16", max_model_len=1024,
        attention_backend="flashinfer", chunked_prefill_size=32,
    )  # fmt: skip
    prompts = parity_prompts()
    async with await AsyncEngine.start(args) as engine:
        outs = await run_all(engine, prompts)
        await engine.check_idle()
    deviations, gaps = await score_by_prefill(
        replace(args, attention_backend="triton"), prompts, outs
    )
    assert max(deviations) < 0.02, sorted(deviations)[-5:]
    assert max(gaps) < 0.02, sorted(gaps)[-5:]


async def score_by_prefill(args: EngineArgs, prompts, outs) -> tuple[list[float], list[float]]:
    """Score greedy outputs teacher-forced by a prefill of prompt + output on an engine of
    ``args``: each token's |logprob difference| and how far below the prefill's argmax it
    is (0 where the prefill picks the same token)."""
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    async with await AsyncEngine.start(args) as engine:
        scored = await final_outputs(
            engine, [p + o.token_ids for p, o in zip(prompts, outs)], scoring
        )
    deviations, gaps = [], []
    for prompt, out, score in zip(prompts, outs, scored):
        for j, ours in enumerate(out.logprobs):
            theirs = score.prompt_logprobs[len(prompt) + j]
            deviations.append(abs(ours.logprob - theirs.logprob))
            gaps.append(theirs.top[0][1] - theirs.logprob)
    return deviations, gaps


async def test_batch1_decode_with_rope_and_kv_write_in_the_qkv_product(ckpt, monkeypatch):
    # At batch 1 a Llama-8B-shaped qkv product (32 + 2 x 8 heads of 128, in the rope-kv table)
    # rotates q/k and writes the KV cache in its epilogue. Decoding each prompt alone (the
    # batch-1 CUDA graph) in fp32 with that epilogue and, in a second engine, without it
    # (the product, then the backend's RoPE + store) must give the same tokens, and logprobs
    # equal to fp32 rounding: the two differ only in that fusion's summation tiles.
    from tokenspeed_kernels import gemv_rope_kv

    path = ckpt(
        "llama", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=512, num_hidden_layers=2,
    )  # fmt: skip
    if (6144, 4096) not in gemv_rope_kv.rope_kv_configs():
        from tokenspeed_kernels import tuning

        pytest.skip(f"{tuning.device_name_of()} has no rope-kv table entry for [6144, 4096]")
    args = EngineArgs(model=str(path), device="cuda", dtype="float32", max_model_len=1024)
    prompts = parity_prompts()
    outs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(gemv_rope_kv, "rope_kv_configs", lambda device=None: {})
        async with await AsyncEngine.start(args) as engine:
            outs[fused] = [await final_output(engine, GREEDY, p) for p in prompts]  # batch 1
            await engine.check_idle()
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    deviations = [
        abs(a.logprob - b.logprob)
        for x, y in zip(outs[True], outs[False])
        for a, b in zip(x.logprobs, y.logprobs)
    ]
    assert max(deviations) < 1e-4, sorted(deviations)[-5:]


async def test_structured_output_on_gpu_compiles_nothing_while_serving(ckpt):
    import json

    import jsonschema
    from helpers.schemas import SCHEMAS

    args = EngineArgs(model=str(ckpt("llama")), device="cuda", dtype="float32", max_model_len=1024)

    async def reply(schema):
        params = SamplingParams(max_tokens=256, temperature=0.0, json_schema=json.dumps(schema))
        return await final_output(engine, params, [5, 6, 7])

    async with await AsyncEngine.start(args) as engine:
        # 1, 3 and 17 constrained rows: every variant of the bitmask kernel serving meets.
        for n in (1, 3, 17):
            schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(n)]
            outs = await asyncio.gather(*(reply(s) for s in schemas))
            for schema, out in zip(schemas, outs):
                assert out.finish_reason == "stop", (schema, out.text)
                jsonschema.validate(json.loads(out.text), schema)
        await engine.check_idle()


async def test_seeded_sampling_on_gpu_is_independent_of_its_batch(ckpt):
    # Temperature rows take the one-pass Triton sampler; each row must read its own
    # temperature and seed (rows 1.. of a batch too) and compile nothing while serving.
    args = EngineArgs(model=str(ckpt("llama")), device="cuda", dtype="float32", max_model_len=1024)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=1234, ignore_eos=True)
    async with await AsyncEngine.start(args) as engine:
        (alone,) = await final_outputs(engine, [[5, 6, 7]], seeded)
        neighbours = [
            SamplingParams(max_tokens=16, temperature=t, seed=i, ignore_eos=True)
            for i, t in enumerate((0.0, 1.5, 0.3))
        ]
        outs = await asyncio.gather(
            *(final_output(engine, p, [9, 10, 11 + i]) for i, p in enumerate(neighbours)),
            final_output(engine, seeded, [5, 6, 7]),
        )
        await engine.check_idle()
    assert outs[-1].token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1
