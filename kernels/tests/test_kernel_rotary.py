import pytest
import torch
from kernel_testing import DEVICE, assert_close, assert_equal_unless_normed_on_gpu, gpu_test
from tokenspeed_kernels.reference import rotary_reference
from tokenspeed_kernels.rotary import apply_rotary

from tokenspeed_aio.model.layers.rotary import build_cos_sin_cache

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _qk(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q and k as strided views of one fused qkv output, as the model produces them."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k_end = (num_q_heads + num_kv_heads) * head_dim
    k = qkv[:, num_q_heads * head_dim : k_end].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize(
    "head_dim,rotary_dim,scaling,dtype",
    [
        (64, 64, None, torch.float32),
        (128, 128, LLAMA3_SCALING, torch.float32),
        (128, 128, LLAMA3_SCALING, torch.bfloat16),
        (64, 32, {"rope_type": "linear", "factor": 2.0}, torch.float32),
    ],
)
def test_rotary_matches_reference_in_place(head_dim, rotary_dim, scaling, dtype):
    cache = build_cos_sin_cache(rotary_dim, 20000, 500000.0, scaling).to(DEVICE)
    qkv, q, k = _qk(9, 8, 2, head_dim, dtype, seed=head_dim)
    v_before = qkv[:, (8 + 2) * head_dim :].clone()
    positions = torch.tensor([0, 1, 2, 17, 17, 1000, 8191, 8192, 19999], device=DEVICE)
    q_ref, k_ref = rotary_reference(q, k, positions, cache)
    apply_rotary(q, k, positions, cache)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(qkv[:, (8 + 2) * head_dim :], v_before), "v must be untouched"


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_cos_sin_cache_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=512, num_attention_heads=4, head_dim=128, rope_theta=500000.0,
        rope_scaling=scaling, max_position_embeddings=131072,
    )  # fmt: skip
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        inv_freq = 1.0 / 500000.0 ** (torch.arange(0, 128, 2).float() / 128)
    else:
        inv_freq, _ = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    positions = torch.tensor([0, 1, 77, 4096, 100000])
    freqs = positions[:, None].float() * inv_freq[None, :]
    cache = build_cos_sin_cache(128, 100001, 500000.0, scaling)[positions]
    torch.testing.assert_close(cache, torch.cat([freqs.cos(), freqs.sin()], -1))


@gpu_test
def test_rotary_large_batch_gpu():
    cache = build_cos_sin_cache(128, 131072, 500000.0, LLAMA3_SCALING).cuda()
    _, q, k = _qk(4096, 32, 8, 128, torch.bfloat16)
    positions = torch.randint(0, 131072, (4096,), device="cuda")
    q_ref, k_ref = rotary_reference(q, k, positions, cache)
    apply_rotary(q, k, positions, cache)
    assert_close(q, q_ref)
    assert_close(k, k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_with_kv_store_equals_rotary_then_kv_write(dtype):
    from tokenspeed_kernels.reference import kv_write_reference

    cache = build_cos_sin_cache(64, 4096, 10000.0).to(DEVICE)
    qkv, q, k = _qk(5, 8, 2, 64, dtype, seed=3)
    v = qkv[:, (8 + 2) * 64 :].view(5, 2, 64)
    positions = torch.tensor([3, 0, 17, 4095, 9], device=DEVICE)
    slots = torch.tensor([7, 40, -1, 2, 33], device=DEVICE)  # -1: padding, stored nowhere
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 16, 2, 64, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(4, 16, 2, 64, generator=gen).to(DEVICE, dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary(q_ref, k_ref, positions, cache)
    kv_write_reference(k_ref, v, expected_k, expected_v, slots)

    apply_rotary(q, k, positions, cache, (v, k_cache, v_cache, slots))
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def _qk_norm_case(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed):
    """Strided q/k/v of one qkv output with per-head scales far from 1 (so the norm matters),
    random q/k norm weights and a KV cache holding garbage."""
    gen = torch.Generator().manual_seed(seed)
    qkv, q, k = _qk(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed=seed)
    scale = torch.exp(2 * torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, 1, generator=gen))
    qkv.view(num_tokens, -1, head_dim).mul_(scale.to(DEVICE, dtype))
    v = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    weights = [(1 + 0.3 * torch.randn(head_dim, generator=gen)).to(DEVICE, dtype) for _ in "qk"]
    cache_shape = (4, 16, num_kv_heads, head_dim)
    caches = [torch.randn(cache_shape, generator=gen).to(DEVICE, dtype) for _ in "kv"]
    return qkv, q, k, v, weights, caches


@pytest.mark.parametrize("kv_store", [False, True], ids=["rotary", "kv_store"])
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim", [(8, 2, 64), (6, 3, 128), (4, 1, 128)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_with_qk_norm_equals_rms_norm_then_rotary(
    dtype, num_q_heads, num_kv_heads, head_dim, kv_store
):
    from tokenspeed_kernels.rmsnorm import rms_norm

    eps = 1e-6
    cache = build_cos_sin_cache(head_dim, 4096, 1000000.0).to(DEVICE)
    _, q, k, v, (q_w, k_w), (k_cache, v_cache) = _qk_norm_case(
        5, num_q_heads, num_kv_heads, head_dim, dtype, seed=head_dim + num_q_heads
    )
    v_before = v.clone()
    positions = torch.tensor([3, 0, 17, 4095, 9], device=DEVICE)
    slots = torch.tensor([7, 40, -1, 2, 33], device=DEVICE)  # -1: padding, stored nowhere
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)  # new, contiguous
    ref_store = (v, expected_k, expected_v, slots) if kv_store else None
    apply_rotary(q_ref, k_ref, positions, cache, ref_store)

    store = (v, k_cache, v_cache, slots) if kv_store else None
    apply_rotary(q, k, positions, cache, store, qk_norm=(q_w, k_w, eps))
    # Bitwise under the interpreter; on a GPU the sums of squares may add in another order
    # (the module doc), an fp32 ulp that survives in fp32 outputs.
    for got, want in [(q, q_ref), (k, k_ref), (k_cache, expected_k)]:
        assert_equal_unless_normed_on_gpu(got, want, normed=True)
    assert torch.equal(v_cache, expected_v)
    assert torch.equal(v, v_before), "v must be untouched"


def test_qk_norm_needs_rotary_over_whole_heads():
    cache = build_cos_sin_cache(32, 64, 10000.0).to(DEVICE)
    _, q, k = _qk(2, 4, 2, 64, torch.float32)
    w = torch.ones(64, device=DEVICE)
    with pytest.raises(AssertionError, match="whole heads"):
        apply_rotary(q, k, torch.tensor([0, 1], device=DEVICE), cache, qk_norm=(w, w, 1e-6))


@gpu_test
def test_rotary_with_qk_norm_and_kv_store_qwen3_8b_gpu():
    # Qwen3-8B: 32 q heads, 8 kv heads of 128, bf16, a prefill-sized batch. The norms' sums
    # of squares add in another order than rms_norm's (register layouts, FMA: rotary.py's
    # module doc), so a few elements may differ by a rounding; all stay within bf16 tolerance.
    from tokenspeed_kernels.rmsnorm import rms_norm

    n, eps = 4096, 1e-6
    cache = build_cos_sin_cache(128, 40960, 1000000.0).cuda()
    _, q, k, v, (q_w, k_w), _ = _qk_norm_case(n, 32, 8, 128, torch.bfloat16, seed=0)
    k_cache = torch.zeros(n // 16 + 1, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    positions = torch.randint(0, 40960, (n,), device="cuda")
    slots = torch.randperm(n, device="cuda") + 16  # block 0 stays the null block
    slots[7] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
    apply_rotary(q_ref, k_ref, positions, cache, (v, expected_k, expected_v, slots))

    apply_rotary(q, k, positions, cache, (v, k_cache, v_cache, slots), qk_norm=(q_w, k_w, eps))
    assert torch.equal(v_cache, expected_v)
    for got, want in ((q, q_ref), (k, k_ref), (k_cache, expected_k)):
        assert_close(got, want)
        assert (got != want).float().mean().item() < 1e-3
    assert k_cache[0].abs().sum() == 0, "slot -1 wrote nothing"
