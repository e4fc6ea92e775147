"""Benchmarks write outside the repository unless told where: $TOKENSPEED_BENCH_DIR, else
the user's cache directory."""

from __future__ import annotations

import json
from pathlib import Path

from tokenspeed_aio.bench import bench_main
from tokenspeed_aio.bench.output import ENV_VAR, default_out_path, results_dir

REPO = Path(__file__).resolve().parents[2]


def test_the_environment_variable_names_the_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "mine"))
    assert results_dir() == tmp_path / "mine"
    path = default_out_path("fixed-1k")
    assert path.parent == tmp_path / "mine"
    assert path.name.startswith("fixed-1k-") and path.suffix == ".json"


def test_without_it_results_go_under_the_user_cache_not_the_repository(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert results_dir() == tmp_path / "cache" / "tokenspeed_aio" / "bench"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert results_dir() == tmp_path / "home" / ".cache" / "tokenspeed_aio" / "bench"
    assert REPO not in results_dir().parents


def test_command_line_without_out_writes_into_the_results_dir(tiny_dir, monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "results"))
    monkeypatch.chdir(tmp_path)
    argv = ["latency", "--shape", "tiny", "--shape-dir", str(tiny_dir.parent)]
    argv += ["--input-len", "8", "--output-len", "4", "--batch", "2", "--num-requests", "2"]
    argv += ["--max-model-len", "256", "--num-kv-blocks", "256", "--page-size", "4"]
    argv += ["--no-roofline", "--no-warmup", "--loop", "asyncio"]
    assert bench_main(argv) == 0
    (written,) = (tmp_path / "results").iterdir()
    assert written.name.startswith("latency-")
    assert json.loads(written.read_text())["runs"][0]["metrics"]["output_tokens"] == 8
    assert not (tmp_path / "bench").exists()
