"""Where a benchmark writes its results when no ``--out`` is given.

One rule for the ``bench`` command and the scripts under ``bench/``: the directory named
by ``$TOKENSPEED_BENCH_DIR``, else ``tokenspeed_aio/bench`` under the user's cache
directory (``$XDG_CACHE_HOME``, else ``~/.cache``). Never the current directory or the
repository: results a report cites are copied into ``bench/results/`` by hand, named by
what and where they measured.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

ENV_VAR = "TOKENSPEED_BENCH_DIR"
# The --out flag's help, the same in every benchmark.
OUT_HELP = (
    "JSON path (default: a new file in $TOKENSPEED_BENCH_DIR, else ~/.cache/tokenspeed_aio/bench)"
)


def results_dir() -> Path:
    """The default results directory (not created here)."""
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        return Path(chosen).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "tokenspeed_aio" / "bench"


def default_out_path(name: str, suffix: str = ".json") -> Path:
    """``results_dir() / NAME-YYYYmmdd-HHMMSS.json``: a new file per invocation."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return results_dir() / f"{name}-{stamp}{suffix}"


def git_commit() -> str:
    """The short commit of the checkout the benchmark runs in ('' outside one)."""
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip()
