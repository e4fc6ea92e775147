import pytest
import torch
from kernel_testing import DEVICE, gpu_test
from tokenspeed_kernels.reference import sample_reference
from tokenspeed_kernels.sampling import greedy, sample

SEEDS = [0, 1, -1, 2**62 + 7, -(2**63), 123456789, 42, 2**31]


def _batch(num_rows, vocab, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).to(DEVICE, dtype)
    temperatures = torch.tensor([0.0, 0.3, 1.0, 1.0, 2.0, 0.7, 1.0, 5.0][:num_rows], device=DEVICE)
    seeds = torch.tensor(SEEDS[:num_rows], dtype=torch.int64, device=DEVICE)
    output_indices = torch.tensor([0, 3, 7, 2**31 + 5, 1, 0, 99, 12][:num_rows], device=DEVICE)
    return logits, temperatures, seeds, output_indices


def _assert_same_draws(sampled, expected, logits, temperatures, seeds, output_indices):
    """Equal ids, except where the two scores are within float noise (a near-tie can flip
    when libm and the kernel's log differ in the last bit)."""
    for row in (sampled != expected).nonzero().flatten().tolist():
        from tokenspeed_kernels.noise import gumbel_noise

        ids = torch.arange(logits.shape[1], device=logits.device)
        noise = gumbel_noise(seeds[row : row + 1], output_indices[row : row + 1], ids)[0]
        score = logits[row].float() / temperatures[row] + noise
        gap = (score[expected[row]] - score[sampled[row]]).item()
        assert abs(gap) < 1e-5, f"row {row}: sampled {sampled[row]} vs {expected[row]}"


@pytest.mark.parametrize("vocab", [1000, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_matches_engine_sampler_draws(vocab, dtype):
    batch = _batch(8, vocab, dtype, seed=vocab)
    greedy, sampled = sample(*batch)
    greedy_ref, sampled_ref = sample_reference(*batch)
    assert torch.equal(greedy, greedy_ref)
    assert torch.equal(sampled[0], greedy[0]), "temperature 0 samples greedily"
    _assert_same_draws(sampled, sampled_ref, *batch)
    assert (sampled[1:] != greedy[1:]).any(), "sampling must not collapse to greedy"


def test_sample_is_independent_of_batch_position():
    logits, temperatures, seeds, output_indices = _batch(8, 777)
    order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4], device=DEVICE)
    _, sampled = sample(logits, temperatures, seeds, output_indices)
    _, shuffled = sample(logits[order], temperatures[order], seeds[order], output_indices[order])
    assert torch.equal(shuffled, sampled[order])


def test_sample_never_picks_masked_tokens_and_breaks_ties_low():
    logits = torch.full((3, 2500), float("-inf"), device=DEVICE)
    logits[:, [7, 2100]] = 1.0  # a tie across vocab tiles: greedy takes the lower id
    temperatures = torch.tensor([1.0, 0.5, 0.0], device=DEVICE)
    seeds = torch.tensor([1, 2, 3], device=DEVICE)
    greedy, sampled = sample(logits, temperatures, seeds, torch.zeros_like(seeds))
    assert greedy.tolist() == [7, 7, 7]
    assert set(sampled.tolist()) <= {7, 2100}


@gpu_test
def test_sample_large_vocab_matches_engine_sampler_gpu():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(256, 151936, generator=gen) * 4).cuda()
    temperatures = torch.rand(256, generator=gen).cuda() * 1.5
    seeds = torch.randint(-(2**63), 2**63 - 1, (256,), generator=gen).cuda()
    output_indices = torch.randint(0, 100000, (256,), generator=gen).cuda()
    batch = (logits, temperatures, seeds, output_indices)
    greedy, sampled = sample(*batch)
    greedy_ref, sampled_ref = sample_reference(*batch)
    assert torch.equal(greedy, greedy_ref)
    # Natively the kernel's division and logs round as torch's: the very same draws.
    assert torch.equal(sampled, sampled_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_torch_argmax_with_ties_to_the_lowest_id(dtype):
    logits, *_ = _batch(5, 4099, dtype, seed=7)
    logits[1, 10] = logits[1, 4097] = logits[1].max() + 1  # a tie across chunks
    logits[2, 3000] = logits[2, 3001] = logits[2].max() + 1  # a tie inside a chunk
    logits[3, 4098] = logits[3].max() + 1  # the last id of a ragged chunk
    assert torch.equal(greedy(logits), logits.float().argmax(dim=-1))
    assert greedy(logits[1:3]).tolist() == [10, 3000]
    assert torch.equal(greedy(logits[:, :1000]), logits[:, :1000].float().argmax(dim=-1))
