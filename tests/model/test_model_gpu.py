"""On CUDA: the same model code matches transformers and never syncs with the host."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_runner import PagedRunner
from transformers import AutoModelForCausalLM

from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run_without_host_sync(runner: PagedRunner, rows) -> torch.Tensor:
    input_ids, positions, ctx = runner.prepare(rows)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            logits = runner.model.compute_logits(runner.model(input_ids, positions, ctx))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return logits


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_cuda_prefill_and_decode_match_transformers_without_host_syncs(checkpoint, arch):
    path = checkpoint(arch)
    config = ModelConfig.from_pretrained(path)
    device = torch.device("cuda")
    model = load_model(config, str(path), dtype=torch.float32, device=device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    runner = PagedRunner(model, config, device=device)
    seqs = [list(range(5, 45)), list(range(100, 109))]

    prefill = _run_without_host_sync(runner, list(enumerate(seqs)))
    decode = _run_without_host_sync(runner, [(0, [7]), (1, [8])])
    seqs[0].append(7)
    seqs[1].append(8)
    with torch.no_grad():
        want = [hf(torch.tensor([s], device=device)).logits[0].float() for s in seqs]
    torch.testing.assert_close(prefill[:40], want[0][:40], atol=1e-3, rtol=0)
    torch.testing.assert_close(prefill[40:], want[1][:9], atol=1e-3, rtol=0)
    torch.testing.assert_close(decode, torch.stack([w[-1] for w in want]), atol=1e-3, rtol=0)


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_cuda_bf16_load_gives_finite_logits(checkpoint, load_format):
    path = checkpoint("qwen3")
    config = ModelConfig.from_pretrained(path)
    device = torch.device("cuda")
    model = load_model(
        config, str(path), dtype=torch.bfloat16, device=device, load_format=load_format
    )
    runner = PagedRunner(model, config, dtype=torch.bfloat16, device=device)
    logits = _run_without_host_sync(runner, [(0, list(range(30))), (1, [1, 2, 3])])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("shape", ["llama-8b", "qwen3-8b"])
def test_batch1_decode_with_norms_fused_into_the_projections_matches_unfused(monkeypatch, shape):
    # Two layers of the 8B shape, so its projections in the norm table take the fused path;
    # random norm weights so the norm's scale matters. The same prompt and teacher-forced decode tokens
    # run with the fused batch-1 path and with it disabled (an empty table).
    from tokenspeed_kernels import gemv

    from tokenspeed_aio.bench.shapes import shape_config
    from tokenspeed_aio.model.layers.norm import RMSNorm

    raw = {**shape_config(shape), "num_hidden_layers": 2, "vocab_size": 1024}
    config = ModelConfig.from_dict(raw)
    device = torch.device("cuda")
    model = load_model(config, "", dtype=torch.bfloat16, device=device, load_format="dummy")
    gen = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=gen))
    calls = []
    fused_product = gemv.norm_gemv

    def counted(*args, **kwargs):
        calls.append(args[4].shape)
        return fused_product(*args, **kwargs)

    monkeypatch.setattr(gemv, "norm_gemv", counted)
    tokens = [5, 900, 17, 64, 300, 2, 11, 700]

    def decode_logits() -> torch.Tensor:
        runner = PagedRunner(model, config, dtype=torch.bfloat16, device=device)
        runner.forward([(0, list(range(3, 40)))])  # prefill: many tokens, never fused
        return torch.cat([runner.forward([(0, [t])]) for t in tokens]).float()

    layer = model.model.layers[0]
    fusable = [
        key in gemv.norm_configs(device)
        for key in (
            (*layer.self_attn.qkv_proj.weight.shape, False),
            (*layer.mlp.gate_up_proj.weight.shape, True),
        )
    ]
    if not any(fusable):
        from tokenspeed_kernels import tuning

        pytest.skip(f"{tuning.device_name_of(device)} has no norm table entry for {shape}")
    fused = decode_logits()
    per_step = sum(fusable) * config.num_hidden_layers
    assert len(calls) == per_step * len(tokens)
    monkeypatch.setattr(gemv, "norm_configs", lambda device=None: {})
    unfused = decode_logits()
    assert len(calls) == per_step * len(tokens)
    # The fused prologue skips two bf16 roundings of the normed input: ~0.06 of logits whose
    # std is ~1.3 after two layers (measured with a torch emulation of the one-pass math).
    tol = 0.1 * unfused.std().item()
    torch.testing.assert_close(fused, unfused, atol=tol, rtol=0)
    top2 = unfused.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * tol  # greedy picks the noise cannot flip
    assert torch.equal(fused.argmax(-1)[clear], unfused.argmax(-1)[clear])


def test_products_on_a_gpu_without_tables_run_cublas(monkeypatch):
    # A GPU whose name has no table files: every product the H200 sends to a Triton kernel
    # -- batch 1 with the norm prologue or the SwiGLU epilogue, 16 rows -- is F.linear.
    from types import SimpleNamespace

    from tokenspeed_kernels import gemv, gemv_rope_kv, skinny_gemm, tuning

    from tokenspeed_aio.model.layers.activation import silu_and_mul
    from tokenspeed_aio.model.layers.norm import RMSNorm
    from tokenspeed_aio.model.ops import products

    def not_called(*args, **kwargs):
        raise AssertionError("a Triton product ran without a table")

    for module, name in ((gemv, "gemv"), (gemv, "norm_gemv"), (skinny_gemm, "skinny_gemm")):
        monkeypatch.setattr(module, name, not_called)
    monkeypatch.setattr(gemv_rope_kv, "norm_gemv_rope_kv", not_called)
    monkeypatch.setenv(tuning.DEVICE_NAME_ENV, "Some_Other_GPU")
    tuning.clear_cache()
    try:
        device = torch.device("cuda")
        gen = torch.Generator().manual_seed(0)

        def rand(*size):
            return torch.randn(*size, generator=gen).to(device, torch.bfloat16)

        qkv, gate_up = rand(6144, 4096) / 64, rand(28672, 4096) / 64
        norm = RMSNorm(4096).to(device, torch.bfloat16)
        norm.weight.data.fill_(1.0)
        for rows in (1, 16):
            x = rand(rows, 4096)
            assert torch.equal(products.linear(x, qkv), F.linear(x, qkv))
            want = silu_and_mul(F.linear(x, gate_up))
            assert torch.equal(products.linear(x, gate_up, act_silu_mul=True), want)
        x, residual = rand(1, 4096), rand(1, 4096)
        y, h = products.norm_linear(norm, x, residual, qkv)
        normed, h_want = norm(x, residual)
        assert torch.equal(h, h_want) and torch.equal(y, F.linear(normed, qkv))
        cos_sin = torch.zeros(64, 128, device=device)
        cache = torch.zeros(4, 16, 8, 128, device=device, dtype=torch.bfloat16)
        rope = (SimpleNamespace(cos_sin_cache=cos_sin), torch.zeros(1, device=device))
        kv = SimpleNamespace(k_cache=cache, v_cache=cache, slot_mapping=None, rope=rope)
        assert products.norm_linear_rope_kv(norm, x, residual, qkv, None, kv) is None
    finally:
        tuning.clear_cache()  # the next lookup reads the restored environment
