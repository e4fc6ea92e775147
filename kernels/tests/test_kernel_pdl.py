"""Programmatic dependent launch of the batch-1 products: when it is on, and that it never
reorders dependent work, among the products and next to ordinarily launched kernels."""

import pytest
import torch
from kernel_testing import DEVICE, gpu_test
from tokenspeed_kernels import decode_attention, pdl, rms_norm
from tokenspeed_kernels.gemv import gemv, norm_gemv
from tokenspeed_kernels.gemv_rope_kv import norm_gemv_rope_kv
from tokenspeed_kernels.sampling import greedy


def test_pdl_is_off_under_the_interpreter_and_when_disabled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled.__wrapped__()
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TOKENSPEED_PDL", "0")
    assert not pdl.enabled.__wrapped__()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: kernels run interpreted")
def test_launches_are_ordinary_without_cuda():
    assert pdl.launch_args() == {"PDL": False, "launch_pdl": False}


def _layer_chain(x, w, caches, steps):
    """Decoder-layer-like launches back to back, each reading what the one before wrote: the
    qkv product with its norm, RoPE and KV write; attention over the cache it wrote (an
    ordinary launch); o_proj; gate_up with its norm and SwiGLU; down (three products in a row);
    then a norm (ordinary), the head and an argmax. A race would show in the bits."""
    k_cache, v_cache, block_tables, seq_lens, cos_sin, positions, slots = caches
    residual, ids = None, []
    for _ in range(steps):
        q, h = norm_gemv_rope_kv(
            x, residual, w["n1"], 1e-6, w["qkv"], None, positions, cos_sin, k_cache, v_cache, slots
        )
        attn = decode_attention(
            q.view(1, 32, 128), k_cache, v_cache, block_tables, seq_lens, 0.09, 4
        )
        a = gemv(attn.view(1, 4096), w["o"])
        g, residual = norm_gemv(a, h, w["n2"], 1e-6, w["gate_up"], silu_mul=True)
        x = gemv(g, w["down"])
        ids.append(greedy(gemv(rms_norm(x, w["n1"], 1e-6), w["head"])))
    return x, torch.cat(ids)


@gpu_test
def test_pdl_chain_equals_ordinary_launches_eager_and_in_a_graph_gpu(monkeypatch):
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * 0.05).to(torch.bfloat16)

    w = {"qkv": rand(6144, 4096), "o": rand(4096, 4096), "gate_up": rand(2 * 6144, 4096),
         "down": rand(4096, 6144), "head": rand(32000, 4096), "n1": rand(4096) + 1,
         "n2": rand(4096) + 1}  # fmt: skip
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 128, 2, device=DEVICE) / 128))
    angles = torch.arange(2048, device=DEVICE)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float().contiguous()
    seq_len = 1000
    caches = (
        rand(64, 16, 8, 128), rand(64, 16, 8, 128),
        torch.arange(1, 64, dtype=torch.int32, device=DEVICE)[None, :],
        torch.tensor([seq_len], dtype=torch.int32, device=DEVICE), cos_sin,
        torch.tensor([seq_len - 1], device=DEVICE), torch.tensor([16 + seq_len - 1], device=DEVICE),
    )  # fmt: skip
    x0 = rand(1, 4096)

    def run(pdl_on: bool, graph: bool):
        monkeypatch.setattr(pdl, "enabled", lambda: pdl_on)
        state = tuple(t.clone() for t in caches[:2]) + caches[2:]
        if not graph:
            return _layer_chain(x0.clone(), w, state, 6)
        x_in = x0.clone()
        _layer_chain(x_in, w, tuple(t.clone() for t in caches[:2]) + caches[2:], 6)  # compile
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = _layer_chain(x_in, w, state, 6)
        for _ in range(3):  # the same result each replay: x_in is read, not written
            g.replay()
        torch.cuda.synchronize()
        return out

    expected = run(False, False)
    for pdl_on, graph in [(True, False), (False, True), (True, True)]:
        got = run(pdl_on, graph)
        assert torch.equal(got[0], expected[0]), (pdl_on, graph)
        assert torch.equal(got[1], expected[1]), (pdl_on, graph)
