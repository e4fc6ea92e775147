"""Paged-cache forwards of every architecture match transformers on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import ARCHS
from paged_runner import PagedRunner
from transformers import AutoModelForCausalLM

from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.loader import load_model

ATOL = 1e-4
RTOL = 1e-4  # fp32 sums: their order follows the CPU's SIMD width (AVX2 or AVX-512)
PROMPT_LENS = (40, 23, 9)


def _load(path, dtype=torch.float32):
    config = ModelConfig.from_pretrained(path)
    model = load_model(config, str(path), dtype=dtype, device=torch.device("cpu"))
    return config, model


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_batched_decode_match_transformers(checkpoint, arch, tied):
    path = checkpoint(arch, tied)
    config, model = _load(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = PagedRunner(model, config)
    seqs = _prompts(config.vocab_size)

    prefill = runner.forward(list(enumerate(seqs)))
    steps = []  # each decode step's logits, [num_seqs, vocab]
    next_tokens = prefill[torch.tensor(PROMPT_LENS).cumsum(0) - 1].argmax(-1).tolist()
    for _ in range(5):
        for seq, token in zip(seqs, next_tokens):
            seq.append(token)
        steps.append(runner.forward([(i, [t]) for i, t in enumerate(next_tokens)]))
        next_tokens = steps[-1].argmax(-1).tolist()

    # The reference is causal: one forward over each final sequence gives the logits of
    # the prefill and of every decode step at once.
    for i, (seq, got_prefill) in enumerate(zip(seqs, prefill.split(PROMPT_LENS))):
        want = _hf_logits(hf, seq)
        torch.testing.assert_close(got_prefill, want[: PROMPT_LENS[i]], atol=ATOL, rtol=RTOL)
        got_decode = torch.stack([step[i] for step in steps])
        torch.testing.assert_close(got_decode, want[PROMPT_LENS[i] :], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_mixed_with_decode_equals_one_shot(checkpoint, arch):
    config, model = _load(checkpoint(arch))
    prompt, other = _prompts(config.vocab_size)[:2]
    one_shot = PagedRunner(model, config).forward([(0, prompt)])

    runner = PagedRunner(model, config, seed=1)
    cut = 17  # mid-block: the second chunk starts inside a partly filled page
    first = runner.forward([(1, other), (0, prompt[:cut])])[len(other) :]
    decode_token = 7
    second = runner.forward([(1, [decode_token]), (0, prompt[cut:])])
    torch.testing.assert_close(torch.cat([first, second[1:]]), one_shot, atol=ATOL, rtol=0)
    decoded = PagedRunner(model, config).forward([(1, [*other, decode_token])])[-1]
    torch.testing.assert_close(second[0], decoded, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_half_precision_load_gives_finite_logits(checkpoint, arch, dtype):
    config, model = _load(checkpoint(arch), dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    runner = PagedRunner(model, config, dtype=dtype)
    seqs = _prompts(config.vocab_size)
    logits = runner.forward(list(enumerate(seqs)))
    assert logits.dtype == dtype  # as the model computes them; the sampler widens them
    assert torch.isfinite(logits).all()
    logits = runner.forward([(i, [1]) for i in range(len(seqs))])
    assert torch.isfinite(logits).all()


def test_qwen3_on_the_triton_backend_matches_the_torch_backend(checkpoint):
    # The triton backend norms q/k per head inside its RoPE + cache-write launch (Triton's
    # interpreter on CPU); the torch backend runs the norm layers, then RoPE.
    from tokenspeed_aio.model.attention.registry import create_backend

    config, model = _load(checkpoint("qwen3"))
    prompts = _prompts(config.vocab_size)[:3]
    logits = []
    for backend in ("torch", "triton"):
        runner = PagedRunner(model, config)
        runner.backend = create_backend(backend, max_model_len=128)
        prefill = runner.forward(list(enumerate(prompts[:2])))
        decode = runner.forward([(0, [5]), (1, [9])])
        # A mixed forward: two decode rows (the decode kernel) beside a fresh prompt (extend).
        mixed = runner.forward([(0, [7]), (1, [3]), (2, prompts[2])])
        logits.append(torch.cat([prefill, decode, mixed]))
    torch.testing.assert_close(logits[1], logits[0], atol=ATOL, rtol=0)
