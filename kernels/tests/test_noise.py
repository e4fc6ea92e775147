"""The counter-based noise hash: deterministic, in range, and well distributed."""

import torch
from tokenspeed_kernels import noise
from tokenspeed_kernels.noise import gumbel_noise, hash_tokens, uniform_noise


def _coords(num_rows: int, vocab_size: int, *, seed0: int = 0, step: int = 0):
    seeds = torch.arange(seed0, seed0 + num_rows, dtype=torch.int64)
    steps = torch.full((num_rows,), step, dtype=torch.int64)
    return seeds, steps, torch.arange(vocab_size)


def test_noise_is_a_pure_function_of_its_coordinates():
    seeds, steps, ids = _coords(64, 1000)
    first = uniform_noise(seeds, steps, ids)
    assert torch.equal(first, uniform_noise(seeds, steps, ids))
    # A row's noise does not depend on the other rows or on its position.
    permutation = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(uniform_noise(seeds[permutation], steps, ids), first[permutation])
    assert torch.equal(uniform_noise(seeds[5:6], steps[5:6], ids), first[5:6])


def test_noise_changes_with_seed_step_and_token():
    seeds, steps, ids = _coords(2, 4096)
    base = hash_tokens(seeds, steps, ids)
    assert not torch.equal(base[0], base[1])  # neighbouring seeds
    assert not torch.equal(base, hash_tokens(seeds, steps + 1, ids))  # next step
    assert base[0].unique().numel() > 4000  # tokens of one row barely collide


def test_multiplier_constants_keep_products_below_2_62():
    constants = noise._ROW_A + noise._ROW_B + noise._TOKEN
    assert all(0 < c < 2**31 and c % 2 == 1 for c in constants)
    seeds = torch.tensor([-(2**63), -1, 0, 2**63 - 1])
    hashed = hash_tokens(seeds, torch.tensor([0, 2**31 - 1, 7, 123]), torch.arange(50000))
    assert hashed.min() >= 0 and hashed.max() < 2**31


def test_uniform_noise_is_strictly_inside_the_unit_interval_and_unbiased():
    seeds, steps, ids = _coords(256, 4096, seed0=10**12, step=3)
    u = uniform_noise(seeds, steps, ids).double()
    n = u.numel()
    assert u.min() > 0.0 and u.max() < 1.0
    sigma = (1 / 12 / n) ** 0.5
    assert abs(u.mean() - 0.5) < 5 * sigma
    assert abs(u.var() - 1 / 12) < 0.002
    counts = torch.histc(u, bins=32, min=0.0, max=1.0)
    expected = n / 32
    chi2 = (((counts - expected) ** 2) / expected).sum()
    assert chi2 < 70  # 31 degrees of freedom; p < 1e-4 beyond this


def test_noise_of_adjacent_tokens_and_steps_is_uncorrelated():
    seeds, steps, ids = _coords(128, 4096)
    u = uniform_noise(seeds, steps, ids)
    v = uniform_noise(seeds, steps + 1, ids)
    pairs = {
        "token": (u[:, :-1], u[:, 1:]),
        "seed": (u[:-1], u[1:]),
        "step": (u, v),
    }
    for name, (a, b) in pairs.items():
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(corr) < 0.01, name


def test_gumbel_noise_is_finite():
    seeds = torch.tensor([0, -1, 2**62, -(2**63)])
    g = gumbel_noise(seeds, torch.tensor([0, 1, 2, 3]), torch.arange(100000))
    assert torch.isfinite(g).all()
    assert abs(g.double().mean() - 0.5772) < 0.01  # Euler-Mascheroni constant


def test_every_input_bit_flips_each_output_bit_half_the_time():
    gen = torch.Generator().manual_seed(3)
    seeds = torch.randint(-(2**63), 2**63 - 1, (256,), generator=gen)
    steps = torch.randint(0, 2**20, (256,), generator=gen)
    ids = torch.arange(128)
    base = hash_tokens(seeds, steps, ids)
    flips = [(1 << i if i < 63 else -(2**63), 0) for i in range(64)]
    flips += [(0, 1 << i) for i in range(20)]
    bits = torch.arange(31, dtype=torch.int32)
    for seed_flip, step_flip in flips:
        diff = (hash_tokens(seeds ^ seed_flip, steps ^ step_flip, ids) ^ base).int()
        rate = ((diff.unsqueeze(-1) >> bits) & 1).float().mean(dim=(0, 1))
        assert (rate - 0.5).abs().max() < 0.02, (seed_flip, step_flip)  # ~7 sigma
