"""On CUDA: the same model code matches transformers and never syncs with the host."""

from __future__ import annotations

import pytest
import torch
from paged_runner import PagedRunner
from transformers import AutoModelForCausalLM

from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run_without_host_sync(runner: PagedRunner, rows) -> torch.Tensor:
    input_ids, positions, ctx = runner.prepare(rows)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            logits = runner.model.compute_logits(runner.model(input_ids, positions, ctx))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return logits


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_cuda_prefill_and_decode_match_transformers_without_host_syncs(checkpoint, arch):
    path = checkpoint(arch)
    config = ModelConfig.from_pretrained(path)
    device = torch.device("cuda")
    model = load_model(config, str(path), dtype=torch.float32, device=device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    runner = PagedRunner(model, config, device=device)
    seqs = [list(range(5, 45)), list(range(100, 109))]

    prefill = _run_without_host_sync(runner, list(enumerate(seqs)))
    decode = _run_without_host_sync(runner, [(0, [7]), (1, [8])])
    seqs[0].append(7)
    seqs[1].append(8)
    with torch.no_grad():
        want = [hf(torch.tensor([s], device=device)).logits[0].float() for s in seqs]
    torch.testing.assert_close(prefill[:40], want[0][:40], atol=1e-3, rtol=0)
    torch.testing.assert_close(prefill[40:], want[1][:9], atol=1e-3, rtol=0)
    torch.testing.assert_close(decode, torch.stack([w[-1] for w in want]), atol=1e-3, rtol=0)


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_cuda_bf16_load_gives_finite_logits(checkpoint, load_format):
    path = checkpoint("qwen3")
    config = ModelConfig.from_pretrained(path)
    device = torch.device("cuda")
    model = load_model(
        config, str(path), dtype=torch.bfloat16, device=device, load_format=load_format
    )
    runner = PagedRunner(model, config, dtype=torch.bfloat16, device=device)
    logits = _run_without_host_sync(runner, [(0, list(range(30))), (1, [1, 2, 3])])
    assert torch.isfinite(logits).all()
