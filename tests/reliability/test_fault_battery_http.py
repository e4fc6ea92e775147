"""Faults with hostile and cancelled requests mixed in, on the CPU server: the L2 host
tier under a small device pool (retractions to the host), a rank SIGKILLed under that
load, a rank SIGKILLed mid-``release_memory_occupation``, and the trainer SIGKILLed
mid-broadcast of a weight update. For each: no request hangs past its timeout, no 5xx
for a client error, no block held in either tier afterwards (or, for a killed rank, the
server exits non-zero within 10 s with no orphan)."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx
import psutil
from helpers.hostile import hostile_rounds
from helpers.workload import run_workload
from rl.harness import GROUP, Trainer

from reliability.harness import GREEDY, run_server
from tokenspeed_aio.bench.ports import free_port

L2 = {"kvstore_ratio": 2, "num_kv_blocks": 48, "max_num_seqs": 16}


async def mixed_load(server, requests: int, seed: int) -> tuple:
    async with server.client(timeout=60) as client:
        done = asyncio.Event()
        hostile = asyncio.create_task(hostile_rounds(client, done))
        try:
            tally = await run_workload(client, requests=requests, concurrency=16, seed=seed)
        finally:
            done.set()
        return tally, await hostile


def test_l2_tier_under_cancellations_and_hostile_input_leaks_nothing(
    reliability_checkpoint, tmp_path
):
    extra = ("--max-sequences-per-request=32",)
    with run_server(reliability_checkpoint, tmp_path, extra=extra, **L2) as server:
        tally, hostile = asyncio.run(mixed_load(server, 60, seed=29))
        assert not tally.errors, tally.errors[:5]
        assert hostile and all(status == 400 for _, status in hostile), hostile[:10]
        m = asyncio.run(server.wait_idle(20))
        assert m["tokenspeed:l2_blocks_active"] == 0
        assert m["tokenspeed:l2_blocks_total"] > 0  # the tier was on
        ok = httpx.post(
            server.base_url + "/v1/completions",
            headers=server.headers,
            json={"prompt": "still here", "max_tokens": 4, **GREEDY},
            timeout=60,
        )
        assert ok.status_code == 200, ok.text
    print(
        f"reliability: l2 battery {dict(tally.outcomes)} hostile={len(hostile)} "
        f"retractions={m.get('tokenspeed:retraction_images_total', 0):.0f}"
    )


def kill_a_rank_during(server, during) -> tuple[float, bool, object]:
    """SIGKILL the server's rank process while ``during`` (a coroutine function given the
    client) runs; (seconds until the server exited, whether no process is left, what
    ``during`` returned)."""
    ranks = server.processes()[1:]

    async def scenario():
        async with server.client(timeout=30) as client:
            work = asyncio.create_task(during(client))
            await asyncio.sleep(1.0)
            ranks[0].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            result = await asyncio.wait_for(work, 30)  # nothing hangs past its timeout
            return killed, result

    killed, result = asyncio.run(scenario())
    server.proc.wait(15)
    exited = time.monotonic() - killed
    orphans = psutil.wait_procs(ranks, timeout=5)[1]
    return exited, not orphans, result


async def load_until_it_fails(client: httpx.AsyncClient) -> list[int | str]:
    """Streams and hostile requests until the server is gone: what each one saw."""
    seen: list[int | str] = []

    async def one(i: int) -> None:
        body = {"prompt": f"x{i}", "max_tokens": 200, "stream": i % 2 == 0, **GREEDY}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                text = (await r.aread()).decode()
                seen.append("error-event" if '"error"' in text else r.status_code)
        except httpx.TransportError:
            seen.append("closed")

    for round_ in range(60):
        await asyncio.gather(*(one(round_ * 8 + i) for i in range(8)))
        if any(s in ("closed", "error-event", 503) for s in seen):
            return seen
    return seen


def test_a_rank_killed_under_l2_load_exits_nonzero_within_10s(reliability_checkpoint, tmp_path):
    with run_server(reliability_checkpoint, tmp_path, exit_code=1, **L2) as server:
        exited, clean, seen = kill_a_rank_during(server, load_until_it_fails)
    assert exited < 10, exited
    assert clean, "orphan rank processes"
    assert all(s in (200, 503, "closed", "error-event") for s in seen), seen
    print(f"reliability: rank killed under l2 load, server gone in {exited:.2f} s")


def test_a_rank_killed_mid_release_memory_occupation(reliability_checkpoint, tmp_path):
    async def release(client: httpx.AsyncClient) -> int | str:
        streams = [
            asyncio.create_task(
                client.post(
                    "/v1/completions", json={"prompt": f"r{i}", "max_tokens": 200, **GREEDY}
                )
            )
            for i in range(4)
        ]
        await asyncio.sleep(0.3)
        try:
            answer = (await client.post("/release_memory_occupation", json={})).status_code
        except httpx.TransportError:
            answer = "closed"
        outcomes = await asyncio.gather(*streams, return_exceptions=True)
        for out in outcomes:  # each request answered or its connection closed
            assert isinstance(out, httpx.TransportError) or out.status_code in (200, 503), out
        return answer

    with run_server(reliability_checkpoint, tmp_path, exit_code=1) as server:
        exited, clean, answer = kill_a_rank_during(server, release)
        log = server.log()
    assert exited < 10, exited
    assert clean, "orphan rank processes"
    assert answer in (200, 503, "closed"), answer
    assert "rank 0 exited" in log or "died" in log, log[-2000:]
    print(f"reliability: rank killed mid-release, answer {answer}, gone in {exited:.2f} s")


def test_the_trainer_sigkilled_mid_broadcast(reliability_checkpoint, tmp_path):
    """The RL cycle over HTTP: the trainer joins the weight group with the server, starts
    broadcasting an update, and is SIGKILLed after a random number of tensors while
    hostile and cancelled requests run. The update fails within the group's timeout
    (502, naming the tensor), the old weights serve on, nothing hangs or leaks."""
    rng = random.Random(7)
    port = free_port()

    async def scenario(server) -> tuple:
        trainer = await Trainer.start(
            "distributed", reliability_checkpoint, tmp_path / "step", port=port,
            world_size=2, group=GROUP, pause_after=rng.randrange(1, 20),
        )  # fmt: skip
        manifest = await trainer.manifest()
        async with server.client(timeout=60) as client:
            probe = {"prompt": "still here", "max_tokens": 6, **GREEDY}
            before = (await client.post("/v1/completions", json=probe)).json()
            init = {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": GROUP, "backend": "gloo", "timeout_seconds": 10,
            }  # fmt: skip
            joined = asyncio.create_task(client.post("/init_weights_update_group", json=init))
            await trainer.expect("ready")
            assert (await joined).status_code == 200, (await joined).text
            done = asyncio.Event()
            hostile = asyncio.create_task(hostile_rounds(client, done, pause=0.3))
            load = asyncio.create_task(run_workload(client, requests=16, concurrency=4, seed=8))
            update = {
                "names": manifest["names"], "dtypes": manifest["dtypes"],
                "shapes": manifest["shapes"], "group_name": GROUP, "flush_cache": False,
                "weight_version": "v2",
            }  # fmt: skip
            updating = asyncio.create_task(
                client.post("/update_weights_from_distributed", json=update)
            )
            await trainer.expect("paused")
            trainer.proc.kill()
            killed = time.monotonic()
            answer = await asyncio.wait_for(updating, 15)
            failed_after = time.monotonic() - killed
            tally = await asyncio.wait_for(load, 120)
            done.set()
            version = (await client.get("/get_weight_version")).json()["weight_version"]
            after = (await client.post("/v1/completions", json=probe)).json()
            destroyed = await client.post(
                "/destroy_weights_update_group", json={"group_name": GROUP}
            )
            await trainer.proc.wait()
        return answer, failed_after, tally, await hostile, version, before, after, destroyed

    with run_server(reliability_checkpoint, tmp_path) as server:
        answer, failed_after, tally, hostile, version, before, after, destroyed = asyncio.run(
            scenario(server)
        )
        assert answer.status_code == 502, answer.text
        assert "broadcast failed at tensor" in answer.text and "unchanged" in answer.text
        assert failed_after < 10, failed_after
        assert not tally.errors, tally.errors[:5]
        assert hostile and all(status == 400 for _, status in hostile), hostile[:10]
        assert version == "default"
        assert after["choices"][0]["text"] == before["choices"][0]["text"]  # the old weights
        assert destroyed.status_code == 200, destroyed.text
        asyncio.run(server.wait_idle(20))
    print(
        f"reliability: trainer killed mid-broadcast: update failed {failed_after:.2f} s after "
        f"the kill ({answer.status_code}); {dict(tally.outcomes)} hostile={len(hostile)}"
    )
