import pytest
import torch
import torch.nn.functional as F
from kernel_testing import DEVICE, assert_close, gpu_test
from tokenspeed_kernels.activation import silu_and_mul
from tokenspeed_kernels.gemv import SILU_MUL_CONFIGS, gemv


def _operands(n, k, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 64), (100, 300), (40, 1100)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(dtype, n, k, bias):
    x, weight, b = _operands(n, k, dtype, bias, seed=n + k)
    y = gemv(x, weight, b)
    assert y.shape == (1, n) and y.dtype == dtype
    assert_close(y, F.linear(x, weight, b))


def test_gemv_of_a_row_cut_from_a_wider_tensor():
    x, weight, _ = _operands(48, 256, torch.float32, False)
    wide = torch.cat([x, x], dim=1)  # a strided row whose K is contiguous
    assert_close(gemv(wide[:, :256], weight), F.linear(x, weight))


@pytest.mark.parametrize("config", [(4, 256, 4, 1), (16, 1024, 8, 3)])
def test_gemv_tile_configs_agree(config):
    x, weight, _ = _operands(96, 700, torch.float32, False, seed=1)
    assert_close(gemv(x, weight, config=config), F.linear(x, weight))


@gpu_test
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gemv_llama_8b_projections_gpu(n, k):
    x, weight, _ = _operands(n, k, torch.bfloat16, False)
    assert_close(gemv(x, weight), F.linear(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [(4, 256, 4, 1), (16, 512, 8, 3)])
def test_silu_mul_gemv_is_the_product_then_the_activation(dtype, config):
    x, weight, _ = _operands(2 * 90, 700, dtype, False, seed=5)
    y = gemv(x, weight, config=config, silu_mul=True)
    assert y.shape == (1, 90)
    # The same values as the product (this kernel, rounded once) followed by the activation.
    assert torch.equal(y, silu_and_mul(gemv(x, weight, config=config)))
    assert_close(y, silu_and_mul(F.linear(x, weight)))


@gpu_test
@pytest.mark.parametrize("n,k", [(28672, 4096), (24576, 4096)])
def test_silu_mul_gemv_gate_up_projections_gpu(n, k):
    x, weight, _ = _operands(n, k, torch.bfloat16, False)
    plain = gemv(x, weight, config=SILU_MUL_CONFIGS[(n, k)])  # the same tiles, same sums
    assert torch.equal(gemv(x, weight, silu_mul=True), silu_and_mul(plain))
    assert_close(gemv(x, weight, silu_mul=True), silu_and_mul(F.linear(x, weight)))
