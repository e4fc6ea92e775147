import pytest
import torch
import torch.nn.functional as F
from kernel_testing import DEVICE, assert_close, gpu_test
from tokenspeed_kernels import tuning
from tokenspeed_kernels.activation import silu_and_mul
from tokenspeed_kernels.gemv import DEFAULT, NORM_DEFAULT, configs, gemv, norm_configs, norm_gemv
from tokenspeed_kernels.gemv_rope_kv import norm_gemv_rope_kv, rope_kv_config
from tokenspeed_kernels.reference import rms_norm_reference, silu_and_mul_reference
from tokenspeed_kernels.rmsnorm import fused_add_rms_norm
from tokenspeed_kernels.rotary import apply_rotary

from tokenspeed_aio.model.layers.rotary import build_cos_sin_cache


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
@pytest.mark.parametrize("k", [700, 2048], ids=["masked", "tiles_divide"])
def test_gemv_tile_configs_agree(config, k):
    # 2048: both configs' tiles divide [96, k], so the weight loads go unmasked (EVEN)
    x, weight, _ = _operands(96, k, torch.float32, False, seed=1)
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
    tiles = configs(x.device, silu_mul=True).get((n, k), DEFAULT)  # what silu_mul=True takes
    plain = gemv(x, weight, config=tiles)  # the same tiles, same sums
    assert torch.equal(gemv(x, weight, silu_mul=True), silu_and_mul(plain))
    assert_close(gemv(x, weight, silu_mul=True), silu_and_mul(F.linear(x, weight)))


def _norm_operands(rows, k, dtype, residual, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(1, k, generator=gen) * 3 for _ in range(2))
    norm_weight = torch.randn(k, generator=gen)
    weight = torch.randn(rows, k, generator=gen) / k**0.5
    x, r, norm_weight, weight = (t.to(DEVICE, dtype) for t in (x, r, norm_weight, weight))
    return x, r if residual else None, norm_weight, weight


def _norm_then_linear(x, residual, norm_weight, eps, weight, bias=None, silu_mul=False):
    """The unfused reference: HF's (add +) RMSNorm, then the product (and the activation)."""
    h = x if residual is None else x + residual
    y = F.linear(rms_norm_reference(h, norm_weight, eps), weight, bias)
    return silu_and_mul_reference(y) if silu_mul else y, h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
def test_norm_gemv_is_the_norm_then_the_product(dtype, residual, silu_mul, two_pass):
    # 300 = 2 full 128-chunks + a masked tail; 40 rows / 10 per program = several programs,
    # of which only the first writes h.
    x, r, norm_weight, weight = _norm_operands(2 * 40, 300, dtype, residual, seed=7)
    inputs = [t.clone() for t in (x, r) if t is not None]
    y, h = norm_gemv(
        x, r, norm_weight, 1e-5, weight, config=(4, 128, 4, 1, two_pass), silu_mul=silu_mul
    )
    y_ref, h_ref = _norm_then_linear(x, r, norm_weight, 1e-5, weight, silu_mul=silu_mul)
    assert y.shape == y_ref.shape and y.dtype == dtype
    assert_close(y, y_ref)
    assert_close(h, h_ref)  # the interpreter's casts truncate: equal only natively
    # Out of place: h is a new tensor and the inputs are left as they were.
    assert all(torch.equal(a, b) for a, b in zip((x, r), inputs))
    if residual:
        assert h.data_ptr() not in (x.data_ptr(), r.data_ptr())
    else:
        assert h is x


@pytest.mark.parametrize("norm", [None, "one_pass", "two_pass"])
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
def test_unmasked_tiles_compute_what_masked_tiles_do(norm, silu_mul):
    """Where the tiles divide the weight its loads go unmasked (``EVEN``); the same rows in a
    weight with one more feature per half (a masked last program) give the same bits."""
    x, r, norm_weight, weight = _norm_operands(2 * 40, 256, torch.bfloat16, True, seed=5)
    halves = weight.view(2, 40, 256) if silu_mul else weight.view(1, 80, 256)
    extra = torch.randn(halves.shape[0], 1, 256).to(DEVICE, torch.bfloat16)
    wider = torch.cat([halves, extra], dim=1).reshape(-1, 256)
    n = halves.shape[1]

    def product(w):
        if norm is None:
            return gemv(x, w, config=(4, 128, 4, 1), silu_mul=silu_mul)
        config = (4, 128, 4, 1, norm == "two_pass")
        return norm_gemv(x, r, norm_weight, 1e-5, w, config=config, silu_mul=silu_mul)[0]

    assert torch.equal(product(weight), product(wider)[:, :n])


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
def test_norm_gemv_adds_the_bias_after_the_norm(two_pass):
    x, r, norm_weight, weight = _norm_operands(48, 200, torch.float32, True, seed=3)
    bias = torch.randn(48, device=DEVICE)
    y, _ = norm_gemv(x, r, norm_weight, 1e-6, weight, bias, config=(8, 64, 4, 1, two_pass))
    assert_close(y, _norm_then_linear(x, r, norm_weight, 1e-6, weight, bias)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_pass_norm_gemv_rounds_as_the_norm_kernel_then_gemv(dtype):
    # The same normed input and the same tiles: equal up to the order of the sum of squares,
    # which can move rstd by an ulp and, rarely, a rounded normed value with it.
    x, r, norm_weight, weight = _norm_operands(64, 512, dtype, True, seed=11)
    config = (4, 128, 4, 1)
    y, h = norm_gemv(x, r, norm_weight, 1e-6, weight, config=(*config, True))
    normed, h_unfused = fused_add_rms_norm(x, r, norm_weight, 1e-6)
    y_unfused = gemv(normed, weight, config=config)
    assert torch.equal(h, h_unfused)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=0)
    torch.testing.assert_close(y, y_unfused, **tol)  # bf16: one ulp


@gpu_test
@pytest.mark.parametrize("shape", list(tuning.table("gemv_norm", device_name="NVIDIA_H200")))
@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
def test_norm_gemv_8b_projections_gpu(shape, two_pass):
    # The H200's fused shapes, with the tiles of the GPU the test runs on.
    rows, k, silu_mul = shape
    x, r, norm_weight, weight = _norm_operands(rows, k, torch.bfloat16, True)
    *tiles, _ = norm_configs(x.device).get(shape, NORM_DEFAULT)
    y, h = norm_gemv(x, r, norm_weight, 1e-5, weight, config=(*tiles, two_pass), silu_mul=silu_mul)
    normed, h_unfused = fused_add_rms_norm(x, r, norm_weight, 1e-5)
    y_unfused = gemv(normed, weight, config=tiles, silu_mul=silu_mul)
    assert torch.equal(h, h_unfused)
    assert_close(y, y_unfused)
    assert_close(y, _norm_then_linear(x, r, norm_weight, 1e-5, weight, silu_mul=silu_mul)[0])
    if two_pass:  # the same normed input but where the sums of squares' order moved rstd
        assert (y != y_unfused).float().mean().item() < 5e-2


class _RopeKV:
    """One token's operands of ``norm_gemv_rope_kv``; the caches start as random garbage."""

    def __init__(self, heads, head_dim, k, dtype, residual, bias, max_position=4096, scaling=None):
        num_q_heads, num_kv_heads = heads
        rows = (num_q_heads + 2 * num_kv_heads) * head_dim
        x, r, norm_weight, weight = _norm_operands(rows, k, dtype, residual, seed=rows + k)
        gen = torch.Generator().manual_seed(k)
        b = torch.randn(rows, generator=gen).to(DEVICE, dtype) if bias else None
        self.norm_args = (x, r, norm_weight, 1e-5, weight, b)
        self.num_q_heads, self.head_dim = num_q_heads, head_dim
        self.split = [num_q_heads, num_kv_heads, num_kv_heads]
        self.cos_sin = build_cos_sin_cache(head_dim, max_position, 500000.0, scaling).to(DEVICE)
        shape = (64, 16, num_kv_heads, head_dim)
        self.k_cache, self.v_cache = (
            torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in "kv"
        )

    def fused(self, positions, slots, config):
        caches = (self.k_cache, self.v_cache)
        return norm_gemv_rope_kv(*self.norm_args, positions, self.cos_sin, *caches, slots, config)

    def unfused(self, positions, slots, config):
        """norm_gemv, then apply_rotary with kv_store on copies of the caches: (q, h, caches)."""
        y, h = norm_gemv(*self.norm_args, config=config)
        q, k, v = y.view(1, -1, self.head_dim).split(self.split, dim=1)
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        apply_rotary(q, k, positions, self.cos_sin, (v, k_cache, v_cache, slots))
        return y[:, : self.num_q_heads * self.head_dim], h, k_cache, v_cache

    def assert_fused_equals_unfused(self, positions, slots, config):
        expected = self.unfused(positions, slots, config)
        q, h = self.fused(positions, slots, config)
        assert q.shape == (1, self.num_q_heads * self.head_dim) and q.dtype == h.dtype
        for actual, want in zip((q, h, self.k_cache, self.v_cache), expected):
            assert torch.equal(actual, want)


def _written_slots(cache, before):
    return (cache != before).flatten(2).any(-1).flatten().nonzero().flatten().tolist()


# GQA: 4 q heads share 2 kv heads; D = 64 is two programs of 16 features per head. bf16 runs
# the two-pass prologue, fp32 the one-pass one.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_norm_gemv_rope_kv_equals_norm_gemv_then_rotary_with_kv_store(dtype, residual, bias):
    op = _RopeKV((4, 2), 64, 256, dtype, residual, bias)
    before = op.k_cache.clone(), op.v_cache.clone()
    positions = torch.tensor([1234], device=DEVICE)
    slots = torch.tensor([7 * 16 + 5], device=DEVICE)
    op.assert_fused_equals_unfused(positions, slots, (16, 128, 4, 1, dtype == torch.bfloat16))
    # The token's slot is written and no other.
    assert _written_slots(op.k_cache, before[0]) == _written_slots(op.v_cache, before[1]) == [117]


def test_norm_gemv_rope_kv_writes_nothing_at_slot_minus_one():
    op = _RopeKV((4, 2), 64, 256, torch.bfloat16, True, False)
    before = op.k_cache.clone(), op.v_cache.clone()
    op.assert_fused_equals_unfused(
        torch.tensor([9], device=DEVICE), torch.tensor([-1], device=DEVICE), (16, 128, 4, 1, False)
    )
    assert torch.equal(op.k_cache, before[0]) and torch.equal(op.v_cache, before[1])


def test_norm_gemv_rope_kv_reads_position_and_slot_from_the_callers_buffers():
    # As a CUDA graph replays it: the same buffers, refilled between launches.
    op = _RopeKV((4, 2), 64, 256, torch.float32, True, False)
    positions = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([3], device=DEVICE)
    q_at_0, _ = op.fused(positions, slots, (16, 128, 4, 1, False))
    positions.fill_(3000)
    slots.fill_(40)
    op.assert_fused_equals_unfused(positions, slots, (16, 128, 4, 1, False))
    q_at_3000, _ = op.fused(positions, slots, (16, 128, 4, 1, False))
    assert not torch.equal(q_at_0, q_at_3000)


def test_norm_gemv_rope_kv_masks_a_partial_block_of_a_head():
    # D = 96: a head half of 48 features is a program of 32 and one of 16 (of 32) lanes; MQA.
    op = _RopeKV((3, 1), 96, 200, torch.bfloat16, True, True)
    positions, slots = torch.tensor([77], device=DEVICE), torch.tensor([20], device=DEVICE)
    op.assert_fused_equals_unfused(positions, slots, (32, 64, 4, 1, True))


@gpu_test
@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
def test_norm_gemv_rope_kv_llama_8b_qkv_gpu(two_pass):
    from test_kernel_rotary import LLAMA3_SCALING

    op = _RopeKV((32, 8), 128, 4096, torch.bfloat16, True, False, 131072, LLAMA3_SCALING)
    *tiles, _ = rope_kv_config(6144, 4096)
    positions, slots = torch.tensor([100000], device=DEVICE), torch.tensor([517], device=DEVICE)
    op.assert_fused_equals_unfused(positions, slots, (*tiles, two_pass))
