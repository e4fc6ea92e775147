import pytest
import torch
from kernel_testing import DEVICE, assert_close, gpu_test
from tokenspeed_kernels.reference import fused_add_rms_norm_reference, rms_norm_reference
from tokenspeed_kernels.rmsnorm import fused_add_rms_norm, rms_norm


def _inputs(rows, hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, hidden, generator=gen) * 3 for _ in range(2))
    weight = torch.randn(hidden, generator=gen)
    return [t.to(DEVICE, dtype) for t in (x, residual, weight)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 300, 4096])
def test_rms_norm_matches_reference(dtype, hidden):
    x, _, weight = _inputs(5, hidden, dtype, seed=hidden)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, rms_norm_reference(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 300])
def test_fused_add_rms_norm_matches_reference(dtype, hidden):
    x, residual, weight = _inputs(7, hidden, dtype, seed=hidden)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    out_ref, residual_ref = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    assert_close(new_residual, residual_ref)
    assert_close(out, out_ref)
    # Out of place: the inputs are left as they were.
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_of_strided_rows_and_3d_input():
    # q-norm style: [tokens, heads, head_dim] cut out of a wider projection output.
    qkv = torch.randn(6, 4 * 64 + 64, device=DEVICE)
    q = qkv[:, : 4 * 64].view(6, 4, 64)
    weight = torch.randn(64, device=DEVICE)
    out = rms_norm(q, weight, 1e-6)
    assert out.shape == q.shape
    assert_close(out, rms_norm_reference(q, weight, 1e-6))


@gpu_test
def test_fused_add_rms_norm_is_bit_exact_with_hf_rounding_gpu():
    # Natively the casts round to nearest even like torch: the residual add is exact and the
    # output differs from HF's math at most by the fp32 reduction order.
    x, residual, weight = _inputs(512, 4096, torch.bfloat16)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    out_ref, residual_ref = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, residual_ref)
    mismatched = (out != out_ref).float().mean().item()
    assert mismatched < 1e-3, mismatched
    assert_close(out, out_ref)
