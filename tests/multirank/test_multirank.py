"""Several rank processes: tensor parallelism over gloo, attention data parallelism,
and faults -- a killed rank and a rank-local error -- that end everything, promptly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers.generation import final_outputs
from helpers.prompts import parity_prompts
from helpers.reference import hf_greedy

from tokenspeed_aio import AsyncEngine, EngineArgs, SamplingParams
from tokenspeed_aio.bench.ports import free_port, free_port_block
from tokenspeed_aio.errors import EngineDeadError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SMALL = dict(max_model_len=512, page_size=4, num_kv_blocks=256, max_num_seqs=16)


async def run_all(engine, prompts, params=GREEDY):
    return await final_outputs(engine, prompts, params)


@pytest.mark.parametrize("kv_heads", [2, 1])
async def test_tp2_matches_transformers(ckpt, kv_heads):
    path = ckpt("qwen3", num_key_value_heads=kv_heads)
    prompts = parity_prompts()
    async with await AsyncEngine.start(EngineArgs(model=str(path), tp=2, **SMALL)) as engine:
        outs = await run_all(engine, prompts)
        await engine.check_idle()
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(str(path), tuple(ids), 8)[0], len(ids)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_tp2_with_l2_matches_transformers(ckpt, policy):
    """Both ranks of the replica image, restore and load back the same blocks, agreeing on
    every acknowledgment: the tokens equal transformers', twice over the same prompts (the
    second time round loads evicted prefixes back from L2)."""
    path = ckpt("qwen3", num_key_value_heads=2)
    prompts = parity_prompts()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    args = EngineArgs(
        model=str(path),
        tp=2,
        max_model_len=512,
        page_size=4,
        num_kv_blocks=80,
        max_num_seqs=16,
        kvstore_ratio=4.0,
        kvstore_write_policy=policy,
    )
    async with await AsyncEngine.start(args) as engine:
        for _ in range(2):
            outs = await run_all(engine, prompts, params)
            for ids, out in zip(prompts, outs):
                assert out.token_ids == hf_greedy(str(path), tuple(ids), 12)[0], len(ids)
        await engine.check_idle()
        load = engine.frontend.loads[0][0]
    assert load.num_preemptions > 0 and load.cache.restores > 0, load
    assert load.cache.load_backs > 0 and load.cache.l2_hit_tokens > 0, load


async def test_tp2_from_l3_matches_transformers(ckpt, tmp_path):
    """A first engine fills the file store, each rank with its own shard of every page; a
    fresh one fetches every hash-complete page from it and answers as transformers does."""
    path = ckpt("qwen3", num_key_value_heads=2)
    prompts = parity_prompts()
    want = [hf_greedy(str(path), tuple(ids), 8)[0] for ids in prompts]
    args = EngineArgs(
        model=str(path), tp=2, **SMALL, kvstore_storage_backend="file",
        kvstore_storage_dir=str(tmp_path),
    )  # fmt: skip
    for attempt in ("first", "fresh"):
        async with await AsyncEngine.start(args) as engine:
            outs = await run_all(engine, prompts)
            assert [out.token_ids for out in outs] == want, attempt
            await engine.check_idle()
            load = engine.frontend.loads[0][0]
    cached = [out.num_cached_tokens for out in outs]
    assert cached == [(len(ids) - 1) // 4 * 4 for ids in prompts], cached
    assert load.cache.l3_fetched_tokens == sum(cached), load.cache
    namespaces = sorted(d.name for d in tmp_path.iterdir())
    assert len(namespaces) == 2, namespaces  # one per rank's shard


async def test_dp2_serves_on_both_replicas(ckpt):
    path = ckpt("llama")
    prompts = parity_prompts(seed=5)
    peaks: dict[int, int] = {}
    async with await AsyncEngine.start(EngineArgs(model=str(path), dp=2, **SMALL)) as engine:

        async def watch():
            while True:
                for replica, (load, _) in engine.frontend.loads.items():
                    peaks[replica] = max(peaks.get(replica, 0), load.running)
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        outs = await run_all(engine, prompts)
        watcher.cancel()
        await engine.check_idle()
    assert peaks.get(0, 0) > 0 and peaks.get(1, 0) > 0, peaks
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(str(path), tuple(ids), 8)[0]


async def test_rank_local_error_fails_every_rank_together(ckpt, monkeypatch, capfd):
    monkeypatch.setenv("TOKENSPEED_INJECT_FAULT", "rank=1,round=3")
    path = ckpt("llama")
    engine = await AsyncEngine.start(EngineArgs(model=str(path), tp=2, **SMALL))
    try:
        with pytest.raises(EngineDeadError):
            await run_all(engine, parity_prompts()[:2], SamplingParams(max_tokens=50))
        launcher = engine._backend.processes.launcher
        deadline = time.monotonic() + 10
        while None in launcher.exit_codes() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert all(code not in (0, None) for code in launcher.exit_codes())
    finally:
        await engine.shutdown()
    log = capfd.readouterr().err
    for rank in (0, 1):  # each rank failed with the injected rank's message
        failure = next(line for line in log.splitlines() if f"rank {rank} failed:" in line)
        assert "injected fault on rank 1 in round 3" in failure, failure


def test_sigkill_of_a_rank_stops_the_server_nonzero(ckpt, tmp_path):
    """The server watches its ranks: one killed mid-serving ends the whole tree fast, and
    leaves no IPC socket file behind."""
    path = ckpt("llama")
    ipc = tmp_path / "ipc"
    ipc.mkdir()
    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 -- closed in the finally
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenspeed_aio",
            "serve",
            str(path),
            "--tp",
            "2",
            "--port",
            str(port),
            "--num-kv-blocks",
            "128",
            "--page-size",
            "4",
            "--max-model-len",
            "512",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(ipc)},
    )
    try:
        ranks = _wait_for_ranks(server, port, 2, timeout=60)
        assert os.listdir(ipc), "the frontend's sockets live here while it serves"
        os.kill(ranks[1].pid, signal.SIGKILL)
        start = time.monotonic()
        code = server.wait(timeout=15)
        assert code != 0
        assert time.monotonic() - start < 10
        _, alive = psutil.wait_procs(ranks, timeout=5)
        assert not alive, f"orphan rank processes: {alive}"
    finally:
        if server.poll() is None:
            server.kill()
        log.close()
    assert "rank 1 exited" in (tmp_path / "serve.log").read_text()
    assert os.listdir(ipc) == []


def _wait_for_ranks(
    server: subprocess.Popen, port: int, n: int, timeout: float
) -> list[psutil.Process]:
    """The server's rank processes, once it serves (/health answers 200; the port itself is
    bound before the model loads)."""
    deadline = time.monotonic() + timeout
    parent = psutil.Process(server.pid)
    while time.monotonic() < deadline:
        ranks = [p for p in parent.children() if "rank_process" in " ".join(p.cmdline())]
        if len(ranks) == n and _healthy(port):
            return ranks
        assert server.poll() is None, "the server exited during startup"
        time.sleep(0.2)
    raise AssertionError("the ranks did not start")


def _healthy(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_two_nodes_form_one_engine(ckpt, tmp_path):
    """--nnodes 2: node 1's rank dials node 0's rendezvous and frontend over TCP."""
    import httpx

    path = ckpt("llama")
    port, base = free_port(), free_port_block(4)
    with contextlib.ExitStack() as stack:
        nodes = _start_two_nodes(stack, path, port, base, tmp_path)
        for i, node in enumerate(nodes):
            try:
                _wait_for_ranks(node, port, 1, timeout=60)
            except AssertionError as e:
                logs = "\n".join((tmp_path / f"node{j}.log").read_text()[-3000:] for j in (0, 1))
                raise AssertionError(f"node {i}: {e}\n{logs}") from e
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": path.name, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        nodes[0].send_signal(signal.SIGTERM)
        assert nodes[0].wait(timeout=20) == 0
        nodes[1].wait(timeout=20)  # its rank saw the frontend go and stopped


@pytest.mark.parametrize("taken", [1, 3], ids=["frontend-socket", "torch-rendezvous"])
def test_a_node_that_fails_its_startup_ends_the_other(ckpt, tmp_path, taken):
    """A port node 0 needs is taken: node 0 fails naming it; once the mesh has formed, node 1
    -- whose rank would otherwise wait out torch.distributed's rendezvous -- fails with it."""
    import socket

    path = ckpt("llama")
    port, base = free_port(), free_port_block(4)
    with contextlib.ExitStack() as stack:
        squatter = stack.enter_context(socket.socket())  # listens, never answers
        squatter.bind(("127.0.0.1", base + taken))
        squatter.listen()
        nodes = _start_two_nodes(stack, path, port, base, tmp_path)
        # Node 1 waits for node 0's rendezvous up to the mesh's formation timeout (60 s) when
        # node 0 fails before its ranks start (the frontend's socket); it is not waited for then.
        waited = nodes if taken == 3 else nodes[:1]
        codes = [node.wait(timeout=30) for node in waited]
    logs = [(tmp_path / f"node{i}.log").read_text() for i in (0, 1)]
    assert codes[0] != 0 and f"{base + taken}" in logs[0], logs[0][-2000:]
    if taken == 3:
        assert codes[1] != 0 and "during startup" in logs[1], logs[1][-2000:]


def _start_two_nodes(
    stack: contextlib.ExitStack, path, port: int, base: int, tmp_path
) -> list[subprocess.Popen]:
    """``serve --tp 2 --nnodes 2``, a rank on each node, logs in ``node{i}.log``; killed when
    ``stack`` closes. Node 0 serves the mesh rendezvous at ``base``, the frontend's sockets
    at base+1 and base+2, the replica's torch.distributed rendezvous at base+3."""
    common = [
        *(sys.executable, "-m", "tokenspeed_aio", "serve", str(path), "--tp", "2"),
        *("--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{base}"),
        *("--num-kv-blocks", "128", "--page-size", "4", "--max-model-len", "512"),
    ]
    roles = [["--node-rank", "0", "--port", str(port)], ["--node-rank", "1"]]
    nodes = []
    for i, role in enumerate(roles):
        log = stack.enter_context(open(tmp_path / f"node{i}.log", "w"))  # noqa: SIM115 -- the stack closes it
        nodes.append(subprocess.Popen(common + role, stdout=log, stderr=subprocess.STDOUT))
        stack.callback(_kill_if_running, nodes[-1])
    return nodes


def _kill_if_running(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()


async def test_tp2_constrained_requests_validate(ckpt):
    """Each rank compiles the grammar; the replica admits it in the same round on both."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(max_tokens=64, temperature=0.0, json_schema=json.dumps(schema))
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    path = ckpt("llama")
    async with await AsyncEngine.start(EngineArgs(model=str(path), tp=2, **SMALL)) as engine:
        constrained, unconstrained = await asyncio.gather(
            run_all(engine, [[5, 6, 7]] * 3, params), run_all(engine, parity_prompts()[:3], plain)
        )
        await engine.check_idle()
    for out in constrained:
        jsonschema.validate(json.loads(out.text), schema)
    for ids, out in zip(parity_prompts()[:3], unconstrained):
        assert out.token_ids == hf_greedy(str(path), tuple(ids), 8)[0]


def test_health_reports_a_stale_rank_and_recovers(ckpt, tmp_path):
    """No load report for 3 s (a frozen rank) makes /health 503; reports resume it."""
    import httpx

    path = ckpt("llama")
    port = free_port()
    command = [
        *(sys.executable, "-m", "tokenspeed_aio", "serve", str(path), "--port", str(port)),
        *("--num-kv-blocks", "64", "--page-size", "4", "--max-model-len", "256"),
    ]
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            [rank] = _wait_for_ranks(server, port, 1, timeout=60)
            health = f"http://127.0.0.1:{port}/health"
            _wait_for_status(health, 200)  # the rank's first load report arrived
            rank.suspend()  # SIGSTOP: the rank stops reporting its load
            time.sleep(3.5)
            stale = httpx.get(health, timeout=5)
            assert stale.status_code == 503 and "no load report" in stale.text, stale.text
            rank.resume()
            _wait_for_status(health, 200)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)


def _wait_for_status(url: str, status: int, timeout: float = 10) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while httpx.get(url, timeout=5).status_code != status:
        assert time.monotonic() < deadline, f"{url} did not answer {status}"
        time.sleep(0.1)
