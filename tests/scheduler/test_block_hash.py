"""Prefix-cache keys are the same in every process: ranks and restarts must agree."""

import subprocess
import sys

from tokenspeed_aio.scheduler.prefix_cache import chain_hash

_PRINT_KEYS = (
    "from tokenspeed_aio.scheduler.prefix_cache import chain_hash as h; "
    "first = h(None, (1, 2, 3)); print(first, h(first, (4, 5, 6)))"
)


def test_block_keys_agree_across_processes():
    # Two fresh interpreters (different address layouts, different hash seeds for str).
    runs = [
        subprocess.run(
            [sys.executable, "-c", _PRINT_KEYS], capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    ]
    first = chain_hash(None, (1, 2, 3))
    assert runs[0] == runs[1] == f"{first} {chain_hash(first, (4, 5, 6))}\n"
