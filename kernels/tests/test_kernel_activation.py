import pytest
import torch
from kernel_testing import DEVICE, assert_close, gpu_test
from tokenspeed_kernels.activation import silu_and_mul
from tokenspeed_kernels.reference import silu_and_mul_reference


def _gate_up(rows, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * d, generator=gen) * 4).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 300, 1500])
def test_silu_and_mul_matches_reference(dtype, d):
    x = _gate_up(5, d, dtype, seed=d)
    out = silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (5, d)
    assert_close(out, silu_and_mul_reference(x))


def test_silu_and_mul_of_strided_rows_and_3d_input():
    wide = _gate_up(6, 96, torch.float32)  # rows of 192, of which the first 128 are gate|up
    x = wide[:, :128]
    out = silu_and_mul(x)
    assert_close(out, silu_and_mul_reference(x))
    x3 = _gate_up(6, 32, torch.float32).view(2, 3, 64)
    assert silu_and_mul(x3).shape == (2, 3, 32)
    assert_close(silu_and_mul(x3), silu_and_mul_reference(x3))


def test_silu_and_mul_of_no_rows():
    assert silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_is_bit_exact_with_torch_gpu(dtype):
    # Precise exp and an IEEE division, as torch's CUDA silu: the same bits, not just close.
    x = _gate_up(512, 14336, dtype)
    assert torch.equal(silu_and_mul(x), silu_and_mul_reference(x))
