"""FP8 checkpoints of every supported format, written by the fixtures, load and compute what
their scheme means: the logits of paged prefill and decode equal transformers' on the
dequantized weights with the activations quantized as the scheme says (W8A8, fp32)."""

from __future__ import annotations

import pytest
import torch
from helpers.fp8_checkpoints import FORMATS, fake_quant_reference, write_fp8_checkpoint
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file
from tokenspeed_kernels import fp8

from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.loader import load_model
from tokenspeed_aio.model.quantization.config import online_config

ATOL = 2e-4
RTOL = 1e-4  # a sum-order ulp can move an input across an e4m3 rounding boundary
LENS = (21, 9)
# Block scales cover 128 x 128: every projection of a fused layer a whole number of blocks.
BLOCK_DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64)  # fmt: skip


@pytest.fixture(scope="module")
def fp8_checkpoint(checkpoint, tmp_path_factory):
    cache = {}

    def get(fmt, arch="llama", kv=False):
        key = (fmt, arch, kv)
        if key not in cache:
            dst = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            src = checkpoint(arch, **BLOCK_DIMS) if "block" in fmt else checkpoint(arch)
            cache[key] = write_fp8_checkpoint(src, dst, fmt, kv)
        return cache[key]

    return get


def _prompts(vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENS]


def _engine_logits(path, quantization=None, steps=3, seed=0):
    config = ModelConfig.from_pretrained(path)
    model = load_model(
        config, str(path), dtype=torch.float32, device=torch.device("cpu"),
        quantization=quantization,
    )  # fmt: skip
    runner = PagedRunner(model, config)
    seqs = _prompts(config.vocab_size, seed)
    prefill = runner.forward(list(enumerate(seqs)))
    tokens = prefill[torch.tensor(LENS).cumsum(0) - 1].argmax(-1).tolist()
    decodes = []
    for _ in range(steps):
        for seq, t in zip(seqs, tokens):
            seq.append(t)
        decodes.append(runner.forward([(i, [t]) for i, t in enumerate(tokens)]))
        tokens = decodes[-1].argmax(-1).tolist()
    return model, seqs, prefill, decodes


def _check_against(reference, seqs, prefill, decodes):
    for i, (seq, got) in enumerate(zip(seqs, prefill.split(LENS))):
        with torch.no_grad():
            want = reference(torch.tensor([seq])).logits[0].float()
        torch.testing.assert_close(got, want[: LENS[i]], atol=ATOL, rtol=RTOL)
        got_decode = torch.stack([step[i] for step in decodes])
        torch.testing.assert_close(got_decode, want[LENS[i] :], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_matches_its_dequantized_reference(fp8_checkpoint, fmt):
    path = fp8_checkpoint(fmt)
    model, seqs, prefill, decodes = _engine_logits(path)
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == fp8.FP8 and layer.fp8 is not None
    assert model.lm_head.weight.dtype == torch.float32  # ignored: stays in 16/32 bits
    _check_against(fake_quant_reference(path, fmt), seqs, prefill, decodes)


def test_qwen3_block_checkpoint_matches_its_reference(fp8_checkpoint):
    path = fp8_checkpoint("fp8-block", "qwen3")
    _, seqs, prefill, decodes = _engine_logits(path)
    _check_against(fake_quant_reference(path, "fp8-block"), seqs, prefill, decodes)


def test_online_quantization_of_a_16_bit_checkpoint(checkpoint):
    path = checkpoint("llama3")
    # Prompts whose activations sit clear of an e4m3 rounding boundary (the RTOL note): with
    # seed 0, on some x86 CPUs one input crosses one and a decode step's logits move by 0.3.
    model, seqs, prefill, decodes = _engine_logits(path, online_config("fp8"), seed=1)
    down = model.model.layers[1].mlp.down_proj
    assert down.weight.dtype == fp8.FP8 and down.weight_scale.shape == (down.weight.shape[0],)
    _check_against(fake_quant_reference(path), seqs, prefill, decodes)


def test_the_quantized_model_is_not_the_16_bit_one(checkpoint, fp8_checkpoint):
    # The reference check can fail: the 16-bit model's logits are farther than ATOL.
    path = fp8_checkpoint("ct-channel")
    _, seqs, prefill, _ = _engine_logits(checkpoint("llama"), steps=0)
    with torch.no_grad():
        want = fake_quant_reference(path, "ct-channel")(torch.tensor([seqs[0]])).logits[0]
    assert (prefill[: LENS[0]] - want).abs().max() > 10 * ATOL


def test_kv_cache_scales_load_per_tensor_and_per_head(fp8_checkpoint):
    for kv in ("tensor", "head"):
        path = fp8_checkpoint("ct-channel", kv=kv)
        config = ModelConfig.from_pretrained(path)
        model = load_model(config, str(path), dtype=torch.float32, device=torch.device("cpu"))
        tensors = load_file(path / "model.safetensors")
        want = tensors["model.layers.1.self_attn.k_scale"].float()
        k_scale, v_scale = model.kv_scales()[1]
        assert torch.equal(k_scale, want.expand(config.num_key_value_heads))
        assert not torch.equal(v_scale, torch.ones_like(v_scale))


def test_a_16_bit_tensor_in_an_fp8_checkpoint_is_refused(fp8_checkpoint, tmp_path):
    import shutil

    path = shutil.copytree(fp8_checkpoint("ct-channel"), tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, path / "model.safetensors")
    config = ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match=r"up_proj.weight' is torch.float32 but .*fp8-channel"):
        load_model(config, str(path), dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("fmt", ["ct-tensor-static", "fp8-block"])
def test_dummy_fp8_weights_of_each_scheme(fp8_checkpoint, fmt):
    path = fp8_checkpoint(fmt)
    config = ModelConfig.from_pretrained(path)
    model = load_model(
        config, str(path), dtype=torch.bfloat16, device=torch.device("cpu"), load_format="dummy"
    )
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == fp8.FP8 and layer.weight.float().abs().max() > 100
    runner = PagedRunner(model, config, dtype=torch.bfloat16)
    logits = runner.forward([(0, list(range(12)))])
    assert torch.isfinite(logits).all()


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runs the Triton kernels on CPU tensors: Triton's interpreter, chosen only where "
    "there is no CUDA device",
)
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_fp8_kv_cache_on_the_triton_backend_matches_the_torch_backend(checkpoint, arch):
    # Both store e4m3 keys and values by the same per-head scales and read them back; the
    # triton kernels (Triton's interpreter) fold the scales into scores and outputs.
    from tokenspeed_aio.model.attention.registry import create_backend

    config = ModelConfig.from_pretrained(checkpoint(arch))
    model = load_model(config, str(checkpoint(arch)), dtype=torch.float32,
                       device=torch.device("cpu"))  # fmt: skip
    for layer, (k, v) in enumerate(model.kv_scales()):
        k.fill_(0.02 + 0.01 * layer)
        v.copy_(torch.linspace(0.01, 0.03, v.numel()))  # per head
    prompts = _prompts(config.vocab_size)
    logits = []
    for backend in ("torch", "triton"):
        runner = PagedRunner(model, config, kv_cache_dtype=fp8.FP8)
        runner.backend = create_backend(backend, max_model_len=128)
        prefill = runner.forward(list(enumerate(prompts)))
        decode = runner.forward([(0, [5]), (1, [9])])
        mixed = runner.forward([(0, [7]), (2, prompts[1][:5])])
        logits.append(torch.cat([prefill, decode, mixed]))
        assert runner.k_caches[0].dtype == fp8.FP8
    torch.testing.assert_close(logits[1], logits[0], atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["ct-channel", "ct-tensor-static", "fp8-block"])
def test_the_fused_fp8_launches_of_more_rows_change_no_bit_gpu(fp8_checkpoint, fmt, monkeypatch):
    # On CUDA an FP8 layer of more rows (fp8_products.py) takes the MLP activation quantized
    # for the down projection -- from the gate/up product's SwiGLU epilogue where down takes
    # per-token scales, else from the SwiGLU launch -- and leaves o_proj's and down's split-K
    # partial sums to the residual-add norm after them. Unfused (no down weight to feed,
    # ``fp8_weight`` None; two ranks as far as the row-parallel layers know, so they sum
    # before the all-reduce) the products quantize and sum themselves. Every product here
    # splits K in two but gate/up, whose epilogue needs whole sums.
    from tokenspeed_kernels import activation, fp8_quant
    from tokenspeed_kernels import fp8_gemm as gemm

    from tokenspeed_aio.model.layers import linear
    from tokenspeed_aio.model.layers.linear import RowParallelLinear

    launches = {"silu_quant": 0, "epilogue": 0, "quantize_rows": 0, "sum": 0}

    def count(module, name, key):
        fn = getattr(module, name)

        def counted(*args):
            launches[key] += 1
            return fn(*args)

        monkeypatch.setattr(module, name, counted)

    count(activation, "silu_and_mul_quant", "silu_quant")
    count(gemm, "fp8_gemm_silu_mul", "epilogue")
    count(fp8_quant, "quantize_rows", "quantize_rows")
    count(gemm, "sum_partials", "sum")
    path = fp8_checkpoint(fmt)
    config = ModelConfig.from_pretrained(path)
    gate_up = 2 * config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    qkv_sums = int(qkv != gate_up)

    class Tiles(dict):
        def get(self, key, default=None):
            n, _, _, m = key
            # gate/up whole, 128 features a program: the fused epilogue's 64 a half is the
            # same MMA (Hopper's wgmma takes 64 rows), so the two give the same bits.
            return (False, m, 128, 128, 1, 4, 2) if n == gate_up else (False, m, 32, 128, 2, 4, 2)

    monkeypatch.setattr(gemm, "configs", lambda device: Tiles())
    fused_tiles = {(gate_up, config.hidden_size, b): (min(b, 64), 64, 128, 4, 2)
                   for b in (16, 32, 64, 128, 256, 512)}  # fmt: skip
    monkeypatch.setattr(gemm, "silu_mul_configs", lambda device: fused_tiles)
    model = load_model(config, str(path), dtype=torch.bfloat16, device=torch.device("cuda"))
    prompts = _prompts(config.vocab_size)
    layers, logits = config.num_hidden_layers, []
    per_token = fmt == "ct-channel"
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(RowParallelLinear, "fp8_weight", property(lambda self: None))
            monkeypatch.setattr(linear, "tp_size", lambda: 2)
        launches.update(dict.fromkeys(launches, 0))
        runner = PagedRunner(model, config, dtype=torch.bfloat16, device=torch.device("cuda"))
        prefill = runner.forward(list(enumerate(prompts)))
        decode = runner.forward([(0, [5]), (1, [9])])
        logits.append(torch.cat([prefill, decode]))
        # Per forward (a prefill, a decode of two rows) and layer: qkv sums its own partials
        # (unless its shape is gate/up's, whose tiles do not split), unfused o_proj and down
        # too; o_proj quantizes its input, unfused down too.
        swiglu = 2 * layers if fused else 0
        assert launches == {
            "silu_quant": 0 if per_token else swiglu,
            "epilogue": swiglu if per_token else 0,
            "quantize_rows": 2 * layers * (1 if fused else 2),
            "sum": 2 * layers * (qkv_sums + (0 if fused else 2)),
        }
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1])
