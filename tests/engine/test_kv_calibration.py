"""An FP8 KV cache's scales at startup (``--kv-cache-scales``): calibrated per layer and KV
head from one 16-bit prefill, they are transformers' post-RoPE k/v amax over the same tokens
times the headroom over 448; on a model whose k/v are small they bring the FP8 engine's
logprobs closer to the unquantized engine's than unit scales do; a checkpoint's scales are
kept under ``auto``; ``unit`` is 1.0."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.checkpoints import make_checkpoint
from helpers.fp8_checkpoints import write_fp8_checkpoint
from helpers.prompts import parity_prompts
from safetensors.torch import load_file, save_file

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.data_plane.device import build_device_side
from tokenspeed_aio.data_plane.kv_calibration import (
    FP8_MAX,
    HEADROOM,
    MAX_TOKENS,
    calibration_token_ids,
)
from tokenspeed_aio.data_plane.specs import RankInfo
from tokenspeed_aio.sampling_params import SamplingParams

# k and v of the small-values checkpoint are the original's times this (q and o_proj's
# weights times its inverse: the model computes exactly what the original does).
SMALL = 2.0**-12


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama3"), "llama3")


@pytest.fixture(scope="module")
def small_kv(llama, tmp_path_factory):
    """``llama`` with k_proj/v_proj scaled by SMALL and q_proj/o_proj by 1 / SMALL."""
    dst = tmp_path_factory.mktemp("small-kv")
    for f in llama.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    factor = {"k_proj": SMALL, "v_proj": SMALL, "q_proj": 1 / SMALL, "o_proj": 1 / SMALL}
    for name in tensors:
        for leaf, f in factor.items():
            if f".{leaf}." in name:
                tensors[name] = tensors[name] * f
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _scales(path, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """The k and v scales [layers, Hkv] the device side starts with."""
    args = EngineArgs(
        model=str(path), device="cpu", page_size=4, num_kv_blocks=16, max_num_seqs=4,
        max_model_len=1024, kv_cache_dtype="fp8", **kw,
    )  # fmt: skip
    build = build_device_side(args, RankInfo())
    try:
        scales = build.handle._runner.kv_scales
        return torch.stack([k for k, _ in scales]).clone(), torch.stack([v for _, v in scales])
    finally:
        build.handle.shutdown()


def _reference_scales(path) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' post-RoPE k and v (its cache) over the calibration tokens: amax per
    layer and head, times the headroom, over 448."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = calibration_token_ids(path, model.config.vocab_size, 1024)
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    k = torch.stack([layer.keys[0] for layer in cache.layers])  # [L, Hkv, T, D]
    v = torch.stack([layer.values[0] for layer in cache.layers])
    return (t.abs().amax(dim=(2, 3)) * HEADROOM / FP8_MAX for t in (k, v))


def test_calibration_tokens_are_the_text_through_the_tokenizer(llama, tmp_path):
    ids = calibration_token_ids(llama, 512, 1024)
    assert 100 < len(ids) <= MAX_TOKENS
    assert calibration_token_ids(llama, 512, 50) == ids[:50]  # truncated to max_model_len
    seeded = calibration_token_ids(tmp_path, 512, 1024)  # no tokenizer.json there
    assert len(seeded) == MAX_TOKENS and seeded == calibration_token_ids(None, 512, 1024)


@pytest.mark.parametrize("mode", ["auto", "calibrate"])
def test_calibrated_scales_are_the_reference_amax(small_kv, mode):
    k, v = _scales(small_kv, kv_cache_scales=mode)
    ref_k, ref_v = _reference_scales(small_kv)
    assert k.shape == ref_k.shape == (2, 2)
    torch.testing.assert_close(k, ref_k, rtol=1e-4, atol=0)
    torch.testing.assert_close(v, ref_v, rtol=1e-4, atol=0)


def test_calibrated_scales_with_qk_norm_are_the_reference_amax(tmp_path):
    """Qwen3: the keys as stored, normed per head, then rotated."""
    path = make_checkpoint(tmp_path, "qwen3")
    k, v = _scales(path, kv_cache_scales="calibrate")
    ref_k, ref_v = _reference_scales(path)
    torch.testing.assert_close(k, ref_k, rtol=1e-4, atol=0)
    torch.testing.assert_close(v, ref_v, rtol=1e-4, atol=0)


def test_scales_follow_the_values(llama, small_kv):
    """The small checkpoint computes what the original does with k/v SMALL times theirs."""
    k, v = _scales(llama, kv_cache_scales="calibrate")
    k_small, v_small = _scales(small_kv, kv_cache_scales="calibrate")
    torch.testing.assert_close(k_small, k * SMALL, rtol=1e-4, atol=0)
    torch.testing.assert_close(v_small, v * SMALL, rtol=1e-4, atol=0)


def test_unit_scales_are_one(small_kv):
    k, v = _scales(small_kv, kv_cache_scales="unit")
    assert bool((k == 1).all()) and bool((v == 1).all())


@pytest.fixture(scope="module")
def with_kv_scales(llama, tmp_path_factory):
    path = write_fp8_checkpoint(llama, tmp_path_factory.mktemp("fp8-kv"), "ct-channel", kv="head")
    assert json.loads((path / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    return path


def test_checkpoint_scales_are_kept_under_auto(with_kv_scales):
    stored = load_file(with_kv_scales / "model.safetensors")
    k, v = _scales(with_kv_scales)  # auto
    for layer in range(2):
        attn = f"model.layers.{layer}.self_attn"
        torch.testing.assert_close(k[layer], stored[f"{attn}.k_scale"].reshape(-1).float())
        torch.testing.assert_close(v[layer], stored[f"{attn}.v_scale"].reshape(-1).float())
    k_cal, _ = _scales(with_kv_scales, kv_cache_scales="calibrate")
    assert not torch.equal(k_cal, k)  # calibrate overrides them
    k_unit, _ = _scales(with_kv_scales, kv_cache_scales="unit")
    assert bool((k_unit == 1).all())


def test_a_bad_value_is_refused():
    with pytest.raises(ValueError, match="kv_cache_scales: must be one of auto, calibrate, unit"):
        EngineArgs(kv_cache_scales="per-tensor")


async def _prompt_logprobs(engine, prompts) -> list[float]:
    """Every prompt token's logprob after the first (teacher-forced: the same tokens in
    every run)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = []
    for ids in prompts:
        last = None
        async for o in engine.generate(prompt_token_ids=ids, sampling_params=params):
            last = o
        out += [p.logprob for p in last.prompt_logprobs[1:]]
    return out


async def test_calibrated_scales_bring_fp8_logprobs_closer(small_kv, start_engine):
    """The FP8-KV engine's prompt logprobs against the unquantized engine's, on the
    small-values checkpoint: mean absolute difference per token."""
    prompts = parity_prompts(seed=5)[2:6]
    base = await _prompt_logprobs(await start_engine(small_kv), prompts)
    errors = {}
    for mode in ("unit", "calibrate"):
        engine = await start_engine(small_kv, kv_cache_dtype="fp8", kv_cache_scales=mode)
        lps = await _prompt_logprobs(engine, prompts)
        errors[mode] = sum(abs(a - b) for a, b in zip(base, lps, strict=True)) / len(base)
    assert errors["calibrate"] < 0.4 * errors["unit"], errors


def test_the_l3_namespace_depends_on_the_scales(llama):
    """Pages of an FP8 cache mean their bytes times the scales: engines whose scales differ
    do not share an L3 namespace; a 16-bit cache's identity has no scales."""
    from tokenspeed_aio.cache.l3.factory import deployment_identity

    args = EngineArgs(model=str(llama), kv_cache_dtype="fp8")
    pages = torch.zeros(2, 4, dtype=torch.float8_e4m3fn)
    ones = tuple((torch.ones(2), torch.ones(2)) for _ in range(2))
    halves = tuple((torch.ones(2), torch.full((2,), 0.5)) for _ in range(2))

    def identity(scales, host_pages=pages):
        return deployment_identity(args, "llama", torch.float32, host_pages, 0, 1, scales)

    assert identity(ones).namespace != identity(halves).namespace
    assert identity(ones).namespace == identity(tuple((k.clone(), v) for k, v in ones)).namespace
    assert identity(None, torch.zeros(2, 4)).dtype == "float32"
