import pytest
import torch
import torch.nn.functional as F
from kernel_testing import DEVICE, assert_close, gpu_test
from tokenspeed_kernels import skinny_gemm as skinny_gemm_module
from tokenspeed_kernels import tuning
from tokenspeed_kernels.activation import silu_and_mul
from tokenspeed_kernels.skinny_gemm import DEFAULT, configs, m_bucket, skinny_gemm

# K = 300: 4 full 64-chunks + a masked tail; SPLIT_K=3 gives slices of 2 chunks: [0, 128),
# [128, 256), [256, 300). N = 88 features: the last tile is cut short for BLOCK_N 32 and 16.
ONE_PASS = (32, 64, 1, 4, 3)
SPLIT = (16, 64, 3, 4, 3)


def _operands(m, n, k, dtype, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 5, 16, 33, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("config", [ONE_PASS, SPLIT], ids=["split_k1", "split_k3"])
def test_skinny_gemm_matches_linear(dtype, m, bias, config):
    x, weight, b = _operands(m, 88, 300, dtype, bias, seed=m)
    y = skinny_gemm(x, weight, b, config=config)
    assert y.shape == (m, 88) and y.dtype == dtype
    assert_close(y, F.linear(x, weight, b))


def test_m_bucket_pads_rows_to_16_32_or_64():
    assert [m_bucket(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]


@pytest.mark.parametrize("config", [ONE_PASS, SPLIT], ids=["split_k1", "split_k3"])
def test_skinny_gemm_of_rows_cut_from_a_wider_tensor(config):
    x, weight, _ = _operands(5, 48, 256, torch.float32)
    wide = torch.cat([x, 2 * x], dim=1)  # rows strided by 512, K contiguous
    assert_close(skinny_gemm(wide[:, :256], weight, config=config), F.linear(x, weight))


def test_split_k_with_empty_slices_is_exact_and_deterministic():
    # 2 chunks of 128 over 8 slices: six slices own no chunk and must add zeros, not garbage.
    x, weight, b = _operands(7, 40, 200, torch.float32, bias=True, seed=3)
    config = (16, 128, 8, 4, 3)
    y = skinny_gemm(x, weight, b, config=config)
    assert_close(y, F.linear(x, weight, b))
    assert torch.equal(y, skinny_gemm(x, weight, b, config=config))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 33])
@pytest.mark.parametrize("config", [ONE_PASS, SPLIT], ids=["split_k1", "split_k3"])
def test_silu_mul_is_the_product_then_the_activation(dtype, m, config):
    x, weight, _ = _operands(m, 2 * 88, 300, dtype, seed=5)
    y = skinny_gemm(x, weight, config=config, silu_mul=True)
    assert y.shape == (m, 88) and y.dtype == dtype
    # The same values as the product (this kernel, same tiles) followed by the activation:
    # bit for bit on a GPU; on CPU the interpreter's numpy exp need not round alike for
    # arrays of different shapes (measured: one ulp on an AMD EPYC).
    unfused = silu_and_mul(skinny_gemm(x, weight, config=config))
    if y.is_cuda:
        assert torch.equal(y, unfused)
    else:
        torch.testing.assert_close(y, unfused, rtol=1e-6, atol=1e-6)
    assert_close(y, silu_and_mul(F.linear(x, weight)))


@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("config", [(16, 64, 1, 4, 3), (16, 64, 3, 4, 3)], ids=["k1", "k3"])
def test_unmasked_tiles_compute_what_masked_tiles_do(silu_mul, config):
    """Where the tiles divide the weight and every K slice holds chunks, its loads go unmasked
    (``EVEN``: 48 features in 16s, K = 192 in three 64-chunks); the same rows in a weight with
    one more feature per half (a masked last program) give the same bits."""
    x, weight, _ = _operands(5, 2 * 48, 192, torch.bfloat16, seed=9)
    halves = weight.view(2, 48, 192) if silu_mul else weight.view(1, 96, 192)
    extra = torch.randn(halves.shape[0], 1, 192).to(DEVICE, torch.bfloat16)
    wider = torch.cat([halves, extra], dim=1).reshape(-1, 192)
    n = halves.shape[1]
    y = skinny_gemm(x, weight, config=config, silu_mul=silu_mul)
    assert torch.equal(y, skinny_gemm(x, wider, config=config, silu_mul=silu_mul)[:, :n])


@pytest.mark.parametrize("config", [ONE_PASS, SPLIT], ids=["split_k1", "split_k3"])
def test_first_tile_before_the_wait_or_after_it_gives_the_same_bits(monkeypatch, config):
    """``_peels`` decides whether the first weight tile is loaded before ``pdl.wait_prior``
    (where its shared memory fits); either way the products are the same."""
    x, weight, b = _operands(5, 2 * 88, 300, torch.bfloat16, bias=True, seed=4)
    peeled = [skinny_gemm(x, weight, b, config), skinny_gemm(x, weight, None, config, True)]
    monkeypatch.setattr(skinny_gemm_module, "_peels", lambda *args: False)
    waits_first = [skinny_gemm(x, weight, b, config), skinny_gemm(x, weight, None, config, True)]
    assert all(torch.equal(p, w) for p, w in zip(peeled, waits_first))


def test_more_than_64_rows_are_refused():
    x, weight, _ = _operands(65, 32, 64, torch.float32)
    with pytest.raises(AssertionError, match="1 to 64 rows"):
        skinny_gemm(x, weight)


# Llama-3-8B's qkv, o_proj, down: the running GPU's table (else DEFAULT), and split-K.
LLAMA_8B = [(6144, 4096), (4096, 4096), (4096, 14336)]
GPU_CONFIGS = [None, (64, 128, 4, 4, 4)]


@gpu_test
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("m", [2, 16, 64])
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=["table", "split_k4"])
def test_skinny_gemm_llama_8b_projections_gpu(n, k, m, config):
    x, weight, _ = _operands(m, n, k, torch.bfloat16)
    y = skinny_gemm(x, weight, config=config)
    assert_close(y, F.linear(x, weight))
    assert torch.equal(y, skinny_gemm(x, weight, config=config))  # no atomics: the same bits


@gpu_test
def test_a_row_count_divisible_by_16_compiles_nothing_new_gpu():
    # A server that captured its decode batches (rows 2-8) meets prefills of any length in
    # the same row bucket; 16 rows must take the kernels 10 rows compiled.
    kernels = (skinny_gemm_module._skinny_gemm_kernel, skinny_gemm_module._split_k_sum_kernel)
    device = torch.cuda.current_device()
    for m in (10, 16):
        x, weight, _ = _operands(m, 96, 256, torch.bfloat16, seed=m)
        for config in (ONE_PASS, SPLIT):
            assert_close(skinny_gemm(x, weight, config=config), F.linear(x, weight))
        if m == 10:
            before = [len(k.device_caches[device][0]) for k in kernels]
    assert [len(k.device_caches[device][0]) for k in kernels] == before


@gpu_test
@pytest.mark.parametrize("m", [2, 16, 64])
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=["table", "split_k4"])
def test_silu_mul_llama_8b_gate_up_gpu(m, config):
    x, weight, _ = _operands(m, 28672, 4096, torch.bfloat16)
    tiles = config or configs(x.device, silu_mul=True).get((28672, 4096, m_bucket(m)), DEFAULT)
    y = skinny_gemm(x, weight, config=config, silu_mul=True)
    assert torch.equal(y, silu_and_mul(skinny_gemm(x, weight, config=tiles)))
    assert_close(y, silu_and_mul(F.linear(x, weight)))


def _table_entries() -> list:
    """(key, silu_mul) of every entry of the running GPU's tables (the H200's without CUDA,
    where the test is skipped anyway); a GPU without tables gets one skipped case saying so."""
    name = tuning.device_name_of() if torch.cuda.is_available() else "NVIDIA_H200"
    entries = [
        (key, silu_mul)
        for silu_mul, table in ((False, "skinny_gemm"), (True, "skinny_gemm_silu_mul"))
        for key in tuning.table(table, device_name=name)
    ]
    skip = pytest.mark.skip(reason=f"no skinny_gemm tables for {name}")
    return entries or [pytest.param(None, None, marks=skip)]


@gpu_test
@pytest.mark.parametrize("key,silu_mul", _table_entries(), ids=lambda v: str(v))
def test_every_table_config_fits_and_matches_linear_gpu(key, silu_mul):
    """Each tile of the running GPU's tables at its bucket's most rows: it compiles within the
    shared memory (the first weight tile before the wait costs a stage where it fits,
    ``_peels``) and computes the product with the table's tiles."""
    n, k, bucket = key
    x, weight, _ = _operands(bucket, n, k, torch.bfloat16)
    y = skinny_gemm(x, weight, silu_mul=silu_mul)
    reference = F.linear(x, weight)
    assert_close(y, silu_and_mul(reference) if silu_mul else reference)
