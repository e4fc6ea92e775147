"""Tensor parallelism: two gloo ranks give the same logits as one process.

Covers KV heads split across ranks (2 KV heads) and replicated (1 KV head), q/k/v bias
shards, a vocab that does not divide by the TP size (padded vocab shard), and tied
embeddings.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from paged_runner import PagedRunner

from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.loader import load_model
from tokenspeed_aio.model.parallel import init_tensor_parallel

WORLD = 2


def _rows(vocab_size: int) -> list[tuple[int, list[int]]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (i, torch.randint(0, vocab_size, (n,), generator=gen).tolist())
        for i, n in enumerate((33, 8))
    ]


def _logits(path: Path) -> torch.Tensor:
    config = ModelConfig.from_pretrained(path)
    model = load_model(config, str(path), dtype=torch.float32, device=torch.device("cpu"))
    runner = PagedRunner(model, config)
    prefill = runner.forward(_rows(config.vocab_size))
    decode = runner.forward([(0, [3]), (1, [5])])
    return torch.cat([prefill, decode])


def _worker(rank: int, paths: list[Path], out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir / 'rendezvous'}", rank=rank, world_size=WORLD
    )
    try:
        init_tensor_parallel(rank, WORLD)
        for i, path in enumerate(paths):
            torch.save(_logits(path), out_dir / f"case{i}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tp2_matches_tp1_with_split_and_replicated_kv_heads(checkpoint, tmp_path, monkeypatch):
    paths = [
        checkpoint("qwen2", tied=True, vocab_size=509),  # 2 KV heads: one per rank
        checkpoint("qwen3", num_key_value_heads=1),  # 1 KV head: replicated on both ranks
    ]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # loopback only; inherited by the ranks
    mp.spawn(_worker, args=(paths, tmp_path), nprocs=WORLD)
    for i, path in enumerate(paths):
        want = _logits(path)
        for rank in range(WORLD):
            got = torch.load(tmp_path / f"case{i}-rank{rank}.pt")
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
