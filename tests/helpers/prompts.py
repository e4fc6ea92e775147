"""Prompts the parity tests share."""

from __future__ import annotations

import random


def parity_prompts(vocab: int = 512, seed: int = 0) -> list[list[int]]:
    """8 prompts of 1 to ~300 tokens (token ids avoid the special tokens 0..4)."""
    rng = random.Random(seed)
    lengths = [1, 3, 17, 40, 64, 129, 200, 301]
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]
