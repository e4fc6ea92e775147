"""The file store's directory fills up under load: a small tmpfs as
``--kvstore-storage-dir`` of a served engine, a mixed load of greedy prompts, requests
abandoned by their clients at random points and hostile requests. The PUTs that find no
space fail and are counted; every request completes with transformers' tokens; nothing is
held afterwards (device, L2, storage ops); and no torn object is left readable: every
object in the directory is whole (its header's page and exactly the bytes it promises),
no temporary is left behind."""

from __future__ import annotations

import asyncio
import random
import struct
import subprocess
import time
from collections import Counter

import httpx
import pytest
from helpers.hostile import hostile_rounds
from helpers.reference import checkpoint_path, hf_greedy
from helpers.workload import run_workload

from tokenspeed_aio.bench.deployment import scrape, start_engine, wait_engine

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
PAGE = 4
MAX_TOKENS = 6
DISK = 96 * 1024  # bytes of tmpfs: a few dozen page objects (each takes a 4 KiB block)
FLAGS = dict(
    max_model_len=512, page_size=PAGE, num_kv_blocks=256, max_num_seqs=16,
    kv_cache_memory_gb=0.25, kvstore_storage_backend="file", kvstore_storage_timeout=2,
)  # fmt: skip
LEAK_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_blocks_active")
LEAK_GAUGES += ("l2_blocks_active", "l3_requests_preparing", "l3_queue_depth")
HEAD = struct.Struct("<4sIqqI")  # an object's header (cache/l3/identity.py)


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "l3"
    mount.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mount)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"needs a small tmpfs to fill (as root); mount refused: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def metric(url: str, name: str) -> float:
    return scrape(url, MODEL).get(f"tokenspeed:{name}", 0.0)


def wait_clean(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while held := {g: v for g in LEAK_GAUGES if (v := metric(url, g))}:
        assert time.monotonic() < deadline, f"not idle after {timeout}s: {held}"
        time.sleep(0.1)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def page_sizes(root) -> Counter:
    """How many of the store's objects carry a page of each size; raises on a temporary
    left behind or on an object that is not one of ours."""
    sizes: Counter = Counter()
    for path in (p for p in root.rglob("*") if p.is_file()):
        assert not path.name.startswith("."), f"a temporary was left: {path}"
        data = path.read_bytes()
        magic, _, _, _, count = HEAD.unpack_from(data)
        assert magic == b"TSL3", path
        sizes[len(data) - HEAD.size - 8 * count] += 1
    return sizes


def test_a_full_storage_directory_fails_puts_cleanly(small_disk, tmp_path):
    checkpoint = checkpoint_path(tmp_path / "ckpt", "llama")
    engine = start_engine(
        checkpoint, tmp_path, "disk-full", model_name=MODEL,
        kvstore_storage_dir=str(small_disk), **FLAGS,
    )  # fmt: skip
    prompts = [prompt(200 + i, 60 + 11 * i) for i in range(10)]
    want = [hf_greedy(str(checkpoint), tuple(p), MAX_TOKENS)[0] for p in prompts]

    async def greedy(client: httpx.AsyncClient, ids: list[int]) -> list[int]:
        sp = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = await client.post("/generate", json={"input_ids": ids, "sampling_params": sp})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    async def run() -> tuple:
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as client:
            stop = asyncio.Event()
            hostile = asyncio.create_task(hostile_rounds(client, stop, pause=0.1))
            load = asyncio.create_task(run_workload(client, requests=30, concurrency=6, seed=41))
            outs = [await greedy(client, p) for p in prompts]
            tally = await asyncio.wait_for(load, 120)
            stop.set()
            return outs, tally, await hostile

    try:
        wait_engine(engine)
        outs, tally, hostile = asyncio.run(run())
        assert outs == want  # every prompt's tokens, whatever the store managed to keep
        assert not tally.errors, tally.errors[:5]
        assert hostile and all(s == 400 for _, s in hostile), hostile[:10]
        wait_clean(engine.url)
        failed = metric(engine.url, 'l3_ops_total{kind="put",outcome="failed"}')
        stored = metric(engine.url, 'l3_ops_total{kind="put",outcome="ok"}')
        assert failed > 0, "the disk never filled"
        # A PUT writes its pages one object at a time, so the one that fills the disk
        # leaves those before it: objects are on disk even when no PUT completed.
        sizes = page_sizes(small_disk)
        assert len(sizes) == 1, sizes  # some objects, and every one holds a whole page
        again = asyncio.run(_again(engine.url, prompts[:3], greedy))
        assert again == want[:3]
        wait_clean(engine.url)
    finally:
        engine.stop()
    print(
        f"reliability: L3 directory full ({DISK // 1024} KiB tmpfs): {stored:.0f} PUTs stored, "
        f"{failed:.0f} failed; {dict(tally.outcomes)} hostile={len(hostile)}; "
        f"objects {sizes}"
    )


async def _again(url: str, prompts: list[list[int]], greedy) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return [await greedy(client, p) for p in prompts]
