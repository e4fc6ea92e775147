"""Programmatic dependent launch of a decode step's products, norms and activations: when it
is on, and that it never reorders dependent work, among them and next to ordinarily launched
kernels, at batch 1 (``gemv``) and at 64 rows (``skinny_gemm``)."""

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import DEVICE, gpu_test
from tokenspeed_kernels import fused_add_rms_norm, pdl, rms_norm
from tokenspeed_kernels.activation import silu_and_mul
from tokenspeed_kernels.decode_attention import decode_attention
from tokenspeed_kernels.gemv import gemv, norm_gemv
from tokenspeed_kernels.gemv_rope_kv import norm_gemv_rope_kv
from tokenspeed_kernels.sampling import greedy
from tokenspeed_kernels.skinny_gemm import skinny_gemm


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
    then a norm, the head and an argmax. A race would show in the bits."""
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


def _skinny_layer_chain(x, w, caches, steps):
    """The same at 64 rows, where the products are ``skinny_gemm``'s: a norm, qkv, attention
    over the cache (ordinary), o_proj split in K (its sum launch), the residual add and norm,
    gate_up then the SwiGLU launch, gate_up with the SwiGLU as its epilogue, down; then a
    norm, the head through cuBLAS (ordinary) and an argmax."""
    k_cache, v_cache, block_tables, seq_lens = caches[:4]
    rows, residual, ids = x.shape[0], None, []
    for _ in range(steps):
        if residual is None:
            normed, h = rms_norm(x, w["n1"], 1e-6), x
        else:
            normed, h = fused_add_rms_norm(x, residual, w["n1"], 1e-6)
        qkv = skinny_gemm(normed, w["qkv"], config=(64, 128, 1, 4, 4))
        attn = decode_attention(
            qkv[:, :4096].view(rows, 32, 128), k_cache, v_cache, block_tables, seq_lens, 0.09, 1
        )
        a = skinny_gemm(attn.view(rows, 4096), w["o"], config=(64, 128, 2, 4, 4))
        normed, residual = fused_add_rms_norm(a, h, w["n2"], 1e-6)
        g = silu_and_mul(skinny_gemm(normed, w["gate_up"], config=(64, 128, 1, 4, 4)))
        g = g + skinny_gemm(normed, w["gate_up"], config=(64, 64, 1, 4, 4), silu_mul=True)
        x = skinny_gemm(g, w["down"], config=(64, 128, 3, 4, 4))
        ids.append(greedy(F.linear(rms_norm(x, w["n1"], 1e-6), w["head"])))
    return x, torch.cat(ids)


def _chain_operands(rows):
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * 0.05).to(torch.bfloat16)

    w = {"qkv": rand(6144, 4096), "o": rand(4096, 4096), "gate_up": rand(2 * 6144, 4096),
         "down": rand(4096, 6144), "head": rand(32000, 4096), "n1": rand(4096) + 1,
         "n2": rand(4096) + 1}  # fmt: skip
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 128, 2, device=DEVICE) / 128))
    angles = torch.arange(2048, device=DEVICE)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float().contiguous()
    seq_len, blocks = 1000, 63  # 63 blocks of 16 per row, row r's from 1 + 63 r
    block_tables = torch.arange(1, 1 + rows * blocks, dtype=torch.int32, device=DEVICE)
    caches = (
        rand(1 + rows * blocks, 16, 8, 128), rand(1 + rows * blocks, 16, 8, 128),
        block_tables.view(rows, blocks),
        torch.full((rows,), seq_len, dtype=torch.int32, device=DEVICE), cos_sin,
        torch.full((rows,), seq_len - 1, device=DEVICE),
        16 + seq_len - 1 + 16 * blocks * torch.arange(rows, device=DEVICE),
    )  # fmt: skip
    return w, caches, rand(rows, 4096)


@gpu_test
@pytest.mark.parametrize("rows", [1, 64], ids=["gemv", "skinny_gemm"])
def test_pdl_chain_equals_ordinary_launches_eager_and_in_a_graph_gpu(monkeypatch, rows):
    chain = _layer_chain if rows == 1 else _skinny_layer_chain
    w, caches, x0 = _chain_operands(rows)

    def run(pdl_on: bool, graph: bool):
        monkeypatch.setattr(pdl, "enabled", lambda: pdl_on)
        state = tuple(t.clone() for t in caches[:2]) + caches[2:]
        if not graph:
            return chain(x0.clone(), w, state, 6)
        x_in = x0.clone()
        chain(x_in, w, tuple(t.clone() for t in caches[:2]) + caches[2:], 6)  # compile
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain(x_in, w, state, 6)
        for _ in range(3):  # the same result each replay: x_in is read, not written
            g.replay()
        torch.cuda.synchronize()
        return out

    expected = run(False, False)
    for pdl_on, graph in [(True, False), (False, True), (True, True)]:
        got = run(pdl_on, graph)
        assert torch.equal(got[0], expected[0]), (pdl_on, graph)
        assert torch.equal(got[1], expected[1]), (pdl_on, graph)
