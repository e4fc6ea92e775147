"""Ranks as separate processes (multiprocessing spawn): a round, and a peer killed mid-call.

The test process is rank 0 itself, so it observes the mesh from inside.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

from tokenspeed_aio.bench.ports import free_port

from .workers import rank_process, run_rank


def _spawn(world: int, port: int, program: str):
    context = mp.get_context("spawn")
    in_step, results = context.Event(), context.Queue()
    processes = [
        context.Process(target=rank_process, args=(rank, world, port, program, in_step, results))
        for rank in range(1, world)
    ]
    for process in processes:
        process.start()
    return processes, in_step, results


def _reap(processes) -> None:
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()


async def _result(results, timeout: float = 20.0):
    return await asyncio.to_thread(results.get, timeout=timeout)


async def test_rank_processes_run_a_scheduling_round():
    port = free_port()
    processes, in_step, results = _spawn(4, port, "scheduling_round")
    try:
        mine = await asyncio.wait_for(run_rank(0, 4, port, "scheduling_round", in_step), 30)
        theirs = dict([await _result(results) for _ in processes])
    finally:
        _reap(processes)
    assert [process.exitcode for process in processes] == [0, 0, 0]
    assert mine == (["req-0"], [1, 1, 2, 2], 2)
    assert theirs == {
        1: (["req-0"], [1, 1, 2, 2], 4),
        2: (["req-2"], [1, 1, 2, 2], 2),
        3: (["req-2"], [1, 1, 2, 2], 4),
    }


async def test_a_killed_rank_process_raises_peer_lost_on_the_others_promptly():
    port = free_port()
    processes, in_step, results = _spawn(3, port, "wait_for_lost_peer")
    victim = processes[0]  # rank 1
    try:
        mine = asyncio.ensure_future(run_rank(0, 3, port, "wait_for_lost_peer", in_step))
        assert await asyncio.to_thread(in_step.wait, 20)  # the mesh formed; one round done
        victim.kill()
        killed_at = time.monotonic()
        peer, message, _ = await asyncio.wait_for(mine, 10)
        seen_after = time.monotonic() - killed_at
        rank, (other_peer, other_message, _) = await _result(results)
    finally:
        _reap(processes)
    assert seen_after < 5.0
    assert (peer, other_peer, rank) == (1, 1, 2)
    for text in (message, other_message):
        assert text.startswith("rank 1 ")
        assert "closed its connection" in text or "connection failed" in text
    assert "rank 0 was in all_gather #2" in message
    assert "rank 2 was in all_gather #2" in other_message
    assert processes[1].exitcode == 0
