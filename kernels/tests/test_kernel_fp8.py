"""FP8 (e4m3) kernels against ``fp8.py``'s torch definitions: activation quantization (alone and
fused into the norm and SwiGLU kernels), the batch-1 product with its norm prologue and SwiGLU
epilogue, and the products of more rows (Triton; ``torch._scaled_mm`` on a GPU)."""

import pytest
import torch
from kernel_testing import DEVICE, assert_close, assert_close_fp8_product, gpu_test
from tokenspeed_kernels import fp8
from tokenspeed_kernels.activation import (
    PERSISTENT_BLOCK,
    silu_and_mul,
    silu_and_mul_quant,
    silu_and_mul_quant_chunks,
    silu_and_mul_quant_rows,
)
from tokenspeed_kernels.fp8 import Fp8Weight
from tokenspeed_kernels.fp8_gemm import fp8_gemm, fp8_gemm_silu_mul
from tokenspeed_kernels.fp8_quant import quantize_by_chunk_amax, quantize_rows
from tokenspeed_kernels.gemv import gemv, norm_gemv
from tokenspeed_kernels.rmsnorm import fused_add_rms_norm, rms_norm_quant
from tokenspeed_kernels.skinny_gemm import sum_partials

GROUP = fp8.BLOCK


def _rand(*shape, scale=1.0, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _weight(n, k, kind, static=False, seed=1):
    wq, s = fp8.quantize_weight(_rand(n, k, scale=k**-0.5, seed=seed, dtype=torch.float32), kind)
    if kind == "tensor":  # held as one scale per row (``fp8.py``)
        kind, s = "channel", s.expand(n).contiguous()
    input_scale = torch.tensor([0.02], device=DEVICE) if static else None
    return Fp8Weight(wq.to(DEVICE), s.to(DEVICE), input_scale)


def _bitwise(a, b):
    assert torch.equal(a[0].float(), b[0].float()) and torch.equal(a[1], b[1])


def test_e4m3_rounding_matches_torch_in_every_range():
    # Ties, carries into the exponent, subnormals and saturation: the interpreter's own
    # conversion gets the first three wrong (``fp8.py``'s NOTE). Infinities saturate and NaN
    # goes to -448, in the kernels and in the torch definition alike.
    special = [2**-9 * 1.5, 2**-9 * 2.5, 15.5, 17.0, 0.0, float("inf"), -float("inf"), float("nan")]
    # An fp32 ulp either side of subnormal ties (shifted onto the normals' grid, the one below
    # used to become the tie).
    ties = torch.tensor([2**-9 * 3.5, 2**-9 * 0.5, 2**-9 * 6.5])
    near = torch.cat([ties.nextafter(torch.zeros(3)), ties.nextafter(torch.ones(3))])
    x = torch.cat([
        torch.linspace(-500, 500, 4001), torch.linspace(-0.03, 0.03, 1001), near,
        torch.tensor(special),
    ]).to(DEVICE).view(1, -1)  # fmt: skip
    got = quantize_rows(x, static_scale=torch.ones(1, device=DEVICE))[0]
    want = fp8.quantize(x, torch.ones(1, device=DEVICE))
    assert torch.equal(got.float(), want.float())
    assert torch.equal(want.float()[0, -3:].cpu(), torch.tensor([448.0, -448.0, -448.0]))
    finite = x.nan_to_num(nan=-448.0)
    assert torch.equal(want.float(), finite.clamp(-448, 448).to(fp8.FP8).float())


@pytest.mark.parametrize("mode", ["token", "group", "static"])
def test_quantize_rows_matches_the_definition(mode):
    x = _rand(5, 300, scale=3.0)
    x[1] = 0  # an all-zero row: the floor scale, zeros
    group = GROUP if mode == "group" else None
    static = torch.tensor([0.01], device=DEVICE) if mode == "static" else None
    _bitwise(quantize_rows(x, group, static), fp8.quantize_rows(x, group, static))


@pytest.mark.parametrize("mode", ["token", "group"])
def test_norm_and_swiglu_quantize_their_own_outputs(mode):
    group = GROUP if mode == "group" else None
    x, r, w = _rand(3, 256, seed=2), _rand(3, 256, seed=3), _rand(256, seed=4)
    q, s, h = rms_norm_quant(x, r, w, 1e-6, group)
    normed, h_ref = fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, h_ref)
    _bitwise((q, s), fp8.quantize_rows(normed, group))
    gate_up = _rand(3, 2 * 384, seed=5)
    _bitwise(silu_and_mul_quant(gate_up, group), fp8.quantize_rows(silu_and_mul(gate_up), group))


def test_swiglu_per_token_scale_is_the_max_over_a_long_rows_chunks():
    # d = 2,500: three chunks of the SwiGLU launch, the last partial; each row's largest value
    # sits in another chunk, so its scale is right only as the max of every chunk's amax.
    d = 2500
    gate_up = _rand(3, 2 * d, seed=6)
    for row, col in enumerate([10, 1500, 2400]):
        gate_up[row, col] = gate_up[row, d + col] = 8.0
    _bitwise(silu_and_mul_quant(gate_up), fp8.quantize_rows(silu_and_mul(gate_up)))


def test_swiglu_persistent_launch_quantizes_every_row_by_its_own_max():
    # Five rows over the interpreter's two programs (rows take turns, each reusing its
    # program's scratch row); d = 2.5 blocks, the last partial; each row's largest value in
    # another block, and a row smaller than the one before it on the same program, whose
    # scratch then still holds the larger row's tail past nothing it rewrites.
    d = 5 * PERSISTENT_BLOCK // 2
    gate_up = _rand(5, 2 * d, seed=12)
    for row, col in enumerate([10, PERSISTENT_BLOCK + 7, d - 1, 3, PERSISTENT_BLOCK]):
        gate_up[row, col] = gate_up[row, d + col] = 8.0 / (row + 1)
    gate_up[4] *= 0.01
    want = fp8.quantize_rows(silu_and_mul(gate_up))
    _bitwise(silu_and_mul_quant_rows(gate_up), want)
    _bitwise(silu_and_mul_quant_rows(gate_up[:0]), (want[0][:0], want[1][:0]))


@pytest.mark.parametrize(
    "kind,static", [("channel", False), ("tensor", True), ("block", False)], ids=str
)
def test_fp8_gemv_matches_the_dequantized_product(kind, static):
    w = _weight(200, 384, kind, static)
    x, bias = _rand(1, 384, seed=6), _rand(200, seed=7)
    want = fp8.linear(x, w.q, w.scale, bias, w.input_scale)
    for config in [(8, 128, 4, 1), (16, 256, 4, 2)]:
        assert_close(gemv(x, w, bias, config), want)


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_fp8_gemv_norm_prologue_and_swiglu_epilogue(kind):
    w = _weight(2 * 256, 384, kind, seed=8)
    x, r, g = _rand(1, 384, seed=9), _rand(1, 384, seed=10), _rand(384, seed=11)
    config = (8, 128, 4, 1, True)  # an FP8 product's prologue is the two-pass one
    y, h = norm_gemv(x, r, g, 1e-6, w, None, config, silu_mul=True)
    normed, h_ref = fused_add_rms_norm(x, r, g, 1e-6)
    assert torch.equal(h, h_ref)
    want = fp8.linear(normed, w.q, w.scale)
    assert torch.equal(y, silu_and_mul(norm_gemv(x, r, g, 1e-6, w, None, config)[0]))
    assert_close(y, silu_and_mul(want))


def test_fp8_gemv_fp16_lanes_hold_the_largest_products():
    # Every quantized value at e4m3's largest magnitude: each 16-value slice sums two fp16
    # lanes of 8 products of 448 x 448 (``fp8_jit.slice_sums``), which fit only because x
    # enters the products scaled by 2**-8. Rows of one sign, of alternating signs, and
    # one whose slices alternate, against the fp32 definition.
    n, k = 16, 512
    sign = torch.ones(n, k)
    sign[1::3] = torch.tensor([1.0, -1.0]).repeat(k // 2)
    sign[2::3] = torch.tensor([1.0] * 16 + [-1.0] * 16).repeat(k // 32)
    q = (448.0 * sign).to(fp8.FP8).to(DEVICE)
    w = Fp8Weight(q, torch.full((n,), 1.0 / k, device=DEVICE))
    x = torch.full((1, k), 3.0, device=DEVICE, dtype=torch.bfloat16)
    want = fp8.linear(x, w.q, w.scale)
    assert want[0, 0].item() == 3.0 * 448  # k products of 448 x 448, times (3 / 448) / k
    for config in [(8, 128, 4, 1), (16, 512, 4, 1)]:
        assert_close(gemv(x, w, None, config), want)


def test_fp8_gemv_prologue_reads_x_in_several_chunks():
    # One warp: the prologue's chunk is 512 values (``gemv.prologue_block``), so 1,200 are
    # three chunks, the last partial; the row's largest value sits in the last one, so the
    # scale is right only where the amax and the sum of squares cover every chunk.
    k = 1200
    w = _weight(64, k, "channel", seed=15)
    x, r, g = _rand(1, k, seed=16), _rand(1, k, seed=17), _rand(k, seed=18)
    x[0, 1100] = 40.0
    assert_close(gemv(x, w, None, (8, 256, 1, 1)), fp8.linear(x, w.q, w.scale))
    y, h = norm_gemv(x, r, g, 1e-6, w, None, (8, 256, 1, 1, True))
    normed, h_ref = fused_add_rms_norm(x, r, g, 1e-6)
    assert torch.equal(h, h_ref)
    assert_close(y, fp8.linear(normed, w.q, w.scale))


@pytest.mark.parametrize(
    "kind,m,config",
    [
        ("channel", 5, (False, 16, 32, 64, 1, 4, 2)),
        ("channel", 70, (False, 32, 64, 128, 3, 4, 2)),  # three M tiles, split-K
        ("block", 9, (False, 16, 64, 128, 2, 4, 2)),
        ("block", 40, (False, 32, 32, 128, 1, 4, 2)),
    ],
    ids=str,
)
def test_fp8_gemm_matches_the_dequantized_product(kind, m, config):
    w = _weight(96, 384, kind, seed=12)
    x, bias = _rand(m, 384, seed=13), _rand(96, seed=14)
    xq, sx = fp8.quantize_rows(x, GROUP if w.block else None)
    y = fp8_gemm(xq.to(DEVICE), sx.to(DEVICE), w, bias, torch.bfloat16, config)
    assert_close(y, fp8.linear(x, w.q, w.scale, bias))


@pytest.mark.parametrize(
    "m,config",
    [(5, (False, 16, 16, 64, 1, 4, 2)), (40, (False, 32, 32, 128, 1, 4, 2))],  # 40: two M tiles
    ids=str,
)
def test_fp8_gemm_swiglu_epilogue_writes_what_the_down_product_quantizes(m, config):
    # gate/up [2d, K] with the activation as the product's epilogue: the plain product with
    # a program's features of each half, then the SwiGLU; the chunks' amaxes it writes give
    # each row's per-token quantization. d = 100: the last program's features are partial.
    d, k = 100, 384
    w = _weight(2 * d, k, "channel", seed=21)
    x = _rand(m, k, seed=22)
    x[1] = 0  # an all-zero row: the floor scale
    xq, sx = quantize_rows(x)
    act, amax = fp8_gemm_silu_mul(xq, sx, w, torch.bfloat16, config)
    block_n = config[2]
    assert amax.shape == (m, -(-d // block_n))
    halves = [Fp8Weight(w.q[i * d : (i + 1) * d], w.scale[i * d : (i + 1) * d]) for i in (0, 1)]
    gate, up = (fp8_gemm(xq, sx, h, None, torch.bfloat16, config) for h in halves)
    assert torch.equal(act, silu_and_mul(torch.cat([gate, up], dim=1)))
    assert_close(act, silu_and_mul(fp8.linear(x, w.q, w.scale)))
    _bitwise(quantize_by_chunk_amax(act, amax, block=64), fp8.quantize_rows(act))


@pytest.mark.parametrize("group", [None, GROUP], ids=["token", "group"])
def test_the_norm_adds_a_split_k_products_partial_sums(group):
    # o_proj/down leave their split-K partials to the residual-add norm after them: the
    # norm's outputs equal those of the same norm on the product's own sum, bit for bit.
    w = _weight(256, 384, "channel", seed=17)
    x, residual, g = _rand(6, 384, seed=18), _rand(6, 256, seed=19), _rand(256, seed=20)
    xq, sx = quantize_rows(x)
    config = (False, 16, 64, 128, 3, 4, 2)  # three K slices
    partials = fp8_gemm(xq, sx, w, None, torch.bfloat16, config, defer_sum=True)
    assert isinstance(partials, fp8.SplitKPartials) and partials.partials.shape[0] == 3
    y = fp8_gemm(xq, sx, w, None, torch.bfloat16, config)
    assert torch.equal(sum_partials(*partials), y)
    q, s, h = rms_norm_quant(partials, residual, g, 1e-6, group)
    q_ref, s_ref, h_ref = rms_norm_quant(y, residual, g, 1e-6, group)
    assert torch.equal(h, h_ref)
    _bitwise((q, s), (q_ref, s_ref))
    # The unquantized norm (the model's last, RMSNorm) takes them the same way.
    normed, h = fused_add_rms_norm(partials, residual, g, 1e-6)
    normed_ref, h_ref = fused_add_rms_norm(y, residual, g, 1e-6)
    assert torch.equal(normed, normed_ref) and torch.equal(h, h_ref)


def test_fp8_gemm_with_a_static_scale():
    w = _weight(64, 256, "tensor", static=True, seed=15)
    x = _rand(7, 256, scale=2.0, seed=16)
    xq, sx = fp8.quantize_rows(x, None, w.input_scale)
    y = fp8_gemm(xq, sx, w, None, torch.bfloat16, (False, 16, 32, 64, 1, 4, 2))
    assert_close(y, fp8.linear(x, w.q, w.scale, None, w.input_scale))


@gpu_test
@pytest.mark.parametrize("m", [2, 64, 256])
def test_scaled_mm_and_triton_agree_on_a_llama_projection_gpu(m):
    w = _weight(6144, 4096, "channel", seed=17)
    x = _rand(m, 4096, seed=18)
    xq, sx = quantize_rows(x)
    want = fp8.linear(x, w.q, w.scale)
    assert_close_fp8_product(
        fp8_gemm(xq, sx, w, None, torch.bfloat16, (True, 0, 0, 0, 0, 0, 0)), want
    )
    assert_close_fp8_product(fp8_gemm(xq, sx, w, None, torch.bfloat16), want)


@gpu_test
@pytest.mark.parametrize("m", [128, 1000])
def test_swiglu_one_launch_is_the_two_launches_on_llamas_mlp_gpu(m):
    # The row counts that take the persistent launch, one of them past its programs (rows
    # take turns), with Llama's 14,336-wide activation: bit for bit the two launches' and the
    # torch definition's, with the device's own e4m3 conversion.
    gate_up = _rand(m, 2 * 14336, seed=25)
    want = fp8.quantize_rows(silu_and_mul(gate_up))
    _bitwise(silu_and_mul_quant(gate_up), want)
    _bitwise(silu_and_mul_quant_chunks(gate_up), want)


@gpu_test
@pytest.mark.parametrize("m", [16, 64])
def test_fp8_gemm_swiglu_epilogue_on_llamas_gate_up_gpu(m):
    # The fused epilogue with the device table's tiles: the SwiGLU of the plain product (to
    # the product's tolerance: another tile of features), and quantized as its own output.
    from tokenspeed_kernels.fp8_gemm import silu_mul_config

    w = _weight(2 * 14336, 4096, "channel", seed=23)
    x = _rand(m, 4096, seed=24)
    xq, sx = quantize_rows(x)
    config = silu_mul_config(m, w, x.device) or (False, m, 64, 128, 1, 4, 3)
    act, amax = fp8_gemm_silu_mul(xq, sx, w, torch.bfloat16, config)
    want = fp8.linear(x, w.q, w.scale)
    assert_close_fp8_product(act, silu_and_mul(want))
    _bitwise(quantize_by_chunk_amax(act, amax), fp8.quantize_rows(act))


@gpu_test
@pytest.mark.parametrize("kind", ["channel", "block"])
def test_fp8_gemv_llama_projections_gpu(kind):
    for n, k in [(6144, 4096), (4096, 14336)]:
        w = _weight(n, k, kind, seed=19)
        x = _rand(1, k, seed=20)
        config = (8, 512, 4, 3) if kind == "channel" else (8, 256, 4, 3)
        assert_close(gemv(x, w, None, config), fp8.linear(x, w.q, w.scale))
