"""On CUDA: a sampling round never syncs the host, and the noise matches the CPU bit for bit."""

import pytest
import torch
from tokenspeed_kernels.noise import uniform_noise

from tokenspeed_aio.model.sampling import Sampler
from tokenspeed_aio.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 32000
PARAMS = [
    SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=5),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(top_k=40, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3),
    SamplingParams(min_tokens=8, stop_token_ids=[7, 8], logprobs=0),
    SamplingParams(),
]


def _round(state, sampler, logits, step):
    rows = len(PARAMS)
    batch = state.prepare(range(rows), [step] * rows)
    out = sampler(logits, batch)
    state.record(batch, out.tokens)
    return out


def test_sampling_round_never_syncs_the_host(make_state):
    state = make_state(PARAMS, VOCAB, device="cuda", prompts=[[1, 2, 3]] * 5, outputs=[[4]] * 5)
    sampler = Sampler()
    logits = torch.randn(len(PARAMS), VOCAB, device="cuda")
    _round(state, sampler, logits, 1)  # warm-up: first pinned blocks, the token-id ramp
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(2, 5):
            # A new owner each round exercises the flush and the penalty-row rebuild.
            state.set_slot(
                step % len(PARAMS),
                PARAMS[step % len(PARAMS)],
                seed=step,
                eos_token_ids=[0],
                prompt_token_ids=[5, 6],
                output_token_ids=[9] * step,
            )
            _round(state, sampler, logits, step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_noise_and_tokens_match_the_cpu(make_state):
    seeds = torch.tensor([0, -1, 2**62 + 12345, -(2**63), 77])
    steps = torch.tensor([0, 1, 2**31 - 1, 5, 1000])
    ids = torch.arange(VOCAB)
    on_cpu = uniform_noise(seeds, steps, ids)
    on_gpu = uniform_noise(seeds.cuda(), steps.cuda(), ids.cuda())
    assert torch.equal(on_cpu, on_gpu.cpu())

    logits = torch.randn(len(PARAMS) * 8, VOCAB)
    tokens = []
    for device in ("cpu", "cuda"):
        state = make_state(PARAMS, VOCAB, device=device, prompts=[[1, 2, 3]] * 5)
        rows = [slot for slot in range(len(PARAMS)) for _ in range(8)]
        batch = state.prepare(rows, list(range(8)) * len(PARAMS))
        tokens.append(Sampler()(logits.to(device), batch).tokens.cpu())
    assert torch.equal(tokens[0], tokens[1])
