"""Forming the mesh: address tables, the rendezvous, and handshakes that must fail clearly."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tokenspeed_aio.bench.ports import HOST, free_port, free_port_block
from tokenspeed_aio.collective import (
    FormationError,
    Mesh,
    Rendezvous,
    base_port_addresses,
)


async def _form_all(connects):
    """Run every rank's connect; each rank's mesh (closed again) or exception."""
    results = await asyncio.wait_for(asyncio.gather(*connects, return_exceptions=True), 20)
    for result in results:
        if isinstance(result, Mesh):
            await result.close()
    return results


async def _gather_over(meshes):
    return await asyncio.gather(*(mesh.world.all_gather(mesh.rank) for mesh in meshes))


async def test_mesh_forms_from_a_base_port():
    world = 3
    peers = base_port_addresses(world, free_port_block(world))
    meshes = await asyncio.gather(
        *(Mesh.connect(r, world, peers, timeout=10) for r in range(world))
    )
    assert await _gather_over(meshes) == [[0, 1, 2]] * world
    for mesh in meshes:
        await mesh.close()


async def test_mesh_forms_from_an_explicit_address_table_in_any_start_order():
    world = 3
    peers = [(HOST, free_port()) for _ in range(world)]

    async def late(rank: int, delay: float) -> Mesh:
        await asyncio.sleep(delay)  # dialers retry until their peer listens
        return await Mesh.connect(rank, world, peers, timeout=10)

    meshes = await asyncio.gather(late(0, 0.3), late(1, 0.0), late(2, 0.1))
    assert await _gather_over(meshes) == [[0, 1, 2]] * world
    for mesh in meshes:
        await mesh.close()


async def test_mesh_forms_through_the_rendezvous_with_os_picked_ports():
    world = 4
    rendezvous = Rendezvous.parse(f"{HOST}:{free_port()}")

    async def late(rank: int, delay: float) -> Mesh:
        await asyncio.sleep(delay)  # rank 0, which serves the rendezvous, comes last
        return await Mesh.connect(rank, world, rendezvous, timeout=10)

    meshes = await asyncio.gather(*(late(r, 0.2 if r == 0 else 0.0) for r in range(world)))
    assert await _gather_over(meshes) == [[0, 1, 2, 3]] * world
    for mesh in meshes:
        await mesh.close()


def test_rendezvous_address_parses_like_dist_init_addr():
    assert Rendezvous.parse("10.0.0.5:29500") == Rendezvous("10.0.0.5", 29500)
    assert Rendezvous.parse("[fe80::1]:29500", "fe80::2") == Rendezvous("fe80::1", 29500, "fe80::2")
    for bad in ("10.0.0.5", ":29500", "host:port"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            Rendezvous.parse(bad)


async def test_a_different_world_size_fails_both_ranks_with_the_reason():
    peers = [(HOST, free_port()) for _ in range(3)]
    results = await _form_all(
        [Mesh.connect(0, 2, peers[:2], timeout=5), Mesh.connect(1, 3, peers, timeout=5)]
    )
    for result in results:
        assert isinstance(result, FormationError)
        assert "world size is 3, rank 0's is 2" in str(result)


async def test_a_different_job_id_fails_both_ranks_with_the_reason():
    peers = [(HOST, free_port()) for _ in range(2)]
    results = await _form_all(
        [
            Mesh.connect(0, 2, peers, job_id="job-a", timeout=5),
            Mesh.connect(1, 2, peers, job_id="job-b", timeout=5),
        ]
    )
    for result in results:
        assert isinstance(result, FormationError)
        assert "job 'job-b'" in str(result) and "job 'job-a'" in str(result)


async def test_the_rendezvous_rejects_another_job_and_fails_every_rank():
    rendezvous = Rendezvous(HOST, free_port())
    results = await _form_all(
        [
            Mesh.connect(0, 3, rendezvous, job_id="job-a", timeout=5),
            Mesh.connect(1, 3, rendezvous, job_id="job-a", timeout=5),
            Mesh.connect(2, 3, rendezvous, job_id="job-b", timeout=5),
        ]
    )
    reason = "the rendezvous rejected rank 2: it belongs to job 'job-b', the rendezvous to 'job-a'"
    for rank, result in enumerate(results):
        assert isinstance(result, FormationError)
        assert str(result) == f"rank {rank}: {reason}"


async def test_a_rank_that_never_starts_fails_formation_at_the_timeout():
    peers = [(HOST, free_port()) for _ in range(3)]
    results = await _form_all(
        [Mesh.connect(0, 3, peers, timeout=0.5), Mesh.connect(1, 3, peers, timeout=0.5)]
    )
    assert isinstance(results[0], FormationError)
    assert "rank 0: ranks [2] did not connect within 0.5 s" in str(results[0])
    assert isinstance(results[1], FormationError)
    assert "ranks [2] did not connect" in str(results[1])


async def test_a_port_in_use_is_a_clear_formation_error():
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(FormationError, match=f"rank 0 cannot listen on {HOST}:{port}"):
            await Mesh.connect(0, 2, [(HOST, port), (HOST, free_port())], timeout=1)


async def test_a_stray_connection_does_not_disturb_formation():
    peers = [(HOST, free_port()) for _ in range(2)]
    first = asyncio.ensure_future(Mesh.connect(0, 2, peers, timeout=10))
    await asyncio.sleep(0.1)
    _, stray = await asyncio.open_connection(*peers[0])
    stray.write(b"\x03\x00\x00\x00GET")  # a frame that is no hello
    meshes = [await Mesh.connect(1, 2, peers, timeout=10), await first]
    assert await _gather_over(meshes) == [[0, 1]] * 2
    stray.close()
    for mesh in meshes:
        await mesh.close()


async def test_connect_validates_its_arguments():
    with pytest.raises(ValueError, match="outside the world"):
        await Mesh.connect(2, 2, [(HOST, 1), (HOST, 2)])
    with pytest.raises(ValueError, match="1 addresses for a world of 2"):
        await Mesh.connect(0, 2, [(HOST, 1)])
