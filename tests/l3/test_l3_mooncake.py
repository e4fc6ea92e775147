"""The L3 tier across engine processes: a real ``mooncake_master`` and two engines (A, B)
on loopback, each lending the store a segment. B answers a prompt A served earlier with an
L3 hit and the same greedy tokens as transformers; killing the master mid-run fails no
request (they recompute, the failures are counted) and leaks nothing; a master that comes
back is used again; killed under hostile and cancelled requests, it fails none either."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers.hostile import hostile_rounds
from helpers.mooncake import needs_mooncake
from helpers.reference import checkpoint_path, hf_greedy
from helpers.workload import run_workload

from tokenspeed_aio.bench.deployment import scrape, start_engine, wait_engine

pytestmark = [needs_mooncake, pytest.mark.timeout(600)]

MODEL = "tiny-llama"
PAGE = 4
MAX_TOKENS = 6
FLAGS = dict(
    max_model_len=512, page_size=PAGE, num_kv_blocks=256, max_num_seqs=16,
    kv_cache_memory_gb=0.25, kvstore_storage_backend="mooncake", kvstore_storage_timeout=2,
    kvstore_mooncake_segment_gb=0.0625,
)  # fmt: skip
LEAK_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_blocks_active")
LEAK_GAUGES += ("l2_blocks_active", "l3_requests_preparing", "l3_queue_depth")
ENDED_SLACK = 8.0  # seconds past the storage timeout the load may take after the kill
# One torch thread per engine: with two engines and their clients on 2 cores, OpenMP
# threads spin-waiting for each other's cores made rounds several times slower.
ENGINE_ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def engines(mooncake_master, tmp_path_factory):
    checkpoint = checkpoint_path(tmp_path_factory.mktemp("l3-ckpt"), "llama")
    logs = tmp_path_factory.mktemp("l3-logs")
    flags = dict(
        FLAGS,
        kvstore_mooncake_master=mooncake_master.address,
        kvstore_mooncake_metadata_server=mooncake_master.metadata_server,
    )
    procs = [
        start_engine(checkpoint, logs, n, model_name=MODEL, env=ENGINE_ENV, **flags) for n in "AB"
    ]
    try:
        for proc in procs:
            wait_engine(proc)
        yield checkpoint, procs
    finally:
        for proc in procs:
            proc.stop()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def generate(url: str, ids: list[int]) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def metric(url: str, name: str) -> float:
    return scrape(url, MODEL).get(f"tokenspeed:{name}", 0.0)


def wait_for(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def wait_clean(procs, timeout: float = 30.0) -> None:
    def clean() -> bool:
        return not any(metric(p.url, g) for p in procs for g in LEAK_GAUGES)

    wait_for(clean, f"not idle: {[{g: metric(p.url, g) for g in LEAK_GAUGES} for p in procs]}")


def failures_and_queries(url: str) -> tuple[float, float]:
    """From one load report: the L3 operations that failed in a way that marks the store
    down (any but a GET's miss: a dead master's get_batch may answer empty at once), and
    the requests whose prefix was queried."""
    values = scrape(url, MODEL)
    failed = values.get("tokenspeed:l3_failures_total", 0.0)
    failed -= values.get('tokenspeed:l3_ops_total{kind="get",outcome="failed"}', 0.0)
    return failed, values["tokenspeed:l3_queries_total"]


def published(url: str, tokens: int, page_bytes_min: int = 1) -> bool:
    return (
        metric(url, 'l3_ops_total{kind="put",outcome="ok"}') > 0
        and metric(url, "l3_put_bytes_total") >= (tokens // PAGE) * page_bytes_min
    )


def test_b_answers_a_prompt_from_l3(engines):
    checkpoint, (a, b) = engines
    ids = prompt(1, 201)
    want = hf_greedy(str(checkpoint), tuple(ids), MAX_TOKENS)[0]
    first = generate(a.url, ids)
    assert first["output_ids"] == want
    full = (len(ids) - 1) // PAGE * PAGE  # the last token is always computed
    wait_for(lambda: metric(a.url, "l3_put_bytes_total") > 0, "A published nothing")
    wait_for(
        lambda: (
            metric(a.url, 'l3_ops_total{kind="put",outcome="ok"}')
            >= metric(a.url, "l3_ops_total")
            - metric(a.url, 'l3_ops_total{kind="query",outcome="ok"}')
        ),
        "A's PUTs did not complete",
    )
    fetched = metric(b.url, "l3_fetched_tokens_total")
    client = openai.OpenAI(base_url=f"{b.url}/v1", api_key="none")
    reply = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.usage.prompt_tokens_details.cached_tokens == full
    assert metric(b.url, "l3_fetched_tokens_total") - fetched == full
    assert metric(b.url, "l3_query_hit_tokens_total") >= full
    assert metric(b.url, "l3_get_bytes_total") > 0
    assert metric(b.url, 'l3_op_seconds_count{kind="get",outcome="ok"}') >= 1  # the histogram
    again = generate(b.url, ids)  # now a device hit on B: same tokens
    assert again["output_ids"] == want
    assert again["meta_info"]["cached_tokens"] == full
    wait_clean([a, b])


def test_killing_the_master_fails_no_request(engines, mooncake_master):
    checkpoint, (a, b) = engines
    prompts = [prompt(100 + i, 40 + 13 * i) for i in range(12)]
    want = [hf_greedy(str(checkpoint), tuple(p), MAX_TOKENS)[0] for p in prompts]
    failures = metric(a.url, "l3_failures_total") + metric(b.url, "l3_failures_total")

    def run(i: int) -> list[int]:
        if i == 4:
            mooncake_master.kill()
        return generate((a, b)[i % 2].url, prompts[i])["output_ids"]

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(run, range(len(prompts))))
    assert outs == want  # every request completed, with the right tokens
    # the store is gone: what the engines still query, fetch or publish fails, counted
    for i, p in enumerate(prompts[:4]):
        assert generate((b, a)[i % 2].url, p)["output_ids"] == want[i]
    wait_for(
        lambda: metric(a.url, "l3_failures_total") + metric(b.url, "l3_failures_total") > failures,
        "no L3 failure was counted",
    )
    wait_clean([a, b])

    mooncake_master.restart()  # back: used again (the client reconnects)
    ids = prompt(7, 121)
    full = (len(ids) - 1) // PAGE * PAGE

    def b_hit() -> bool:
        # A publishes ids (once its client reached the new master); B then fetches them.
        puts = metric(a.url, 'l3_ops_total{kind="put",outcome="ok"}')
        generate(a.url, ids)
        with contextlib.suppress(AssertionError):
            wait_for(
                lambda: metric(a.url, 'l3_ops_total{kind="put",outcome="ok"}') > puts,
                "no PUT",
                timeout=8,
            )
        fetched = metric(b.url, "l3_fetched_tokens_total")
        out = generate(b.url, ids)
        ok = metric(b.url, "l3_fetched_tokens_total") - fetched == full
        assert out["output_ids"] == hf_greedy(str(checkpoint), tuple(ids), MAX_TOKENS)[0]
        if not ok:
            ids[:] = prompt(int(time.monotonic() * 1000), 121)  # a fresh prefix for B
        return ok

    wait_for(b_hit, "the restarted master was not used again", timeout=60)
    wait_clean([a, b])


def test_killing_the_master_under_hostile_and_cancelled_requests(engines, mooncake_master):
    """The master SIGKILLed at a random point of a mixed load on both engines: requests
    abandoned by their clients at random points beside hostile ones. No valid request
    fails; once an engine counted an L3 failure that marks the store down it queries the
    store for no request any more (the failure and the down state travel in the same
    report), so the last request
    ends within the storage timeout (plus slack) of the kill -- a request waits on the
    dead store only while its op was in flight when it died; every hostile one is 400,
    both engines hold nothing afterwards (device, L2, storage ops), and a greedy prompt
    still gets transformers' tokens."""
    checkpoint, (a, b) = engines
    rng = random.Random(29)
    at = rng.uniform(0.3, 1.5)
    failures = metric(a.url, "l3_failures_total") + metric(b.url, "l3_failures_total")
    before = [failures_and_queries(e.url)[0] for e in (a, b)]

    async def queried_once_down(gathered) -> list[float | None]:
        """Each engine's query count as of its first report with a failure since the kill
        (None: no failure seen while the load ran)."""
        queried: list[float | None] = [None, None]
        while not gathered.done() and None in queried:
            for i, e in enumerate((a, b)):
                failed, queries = await asyncio.to_thread(failures_and_queries, e.url)
                if queried[i] is None and failed > before[i]:
                    queried[i] = queries
            await asyncio.sleep(0.05)
        return queried

    async def run() -> tuple:
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=60) as ca,
            httpx.AsyncClient(base_url=b.url, timeout=60) as cb,
        ):
            stop = asyncio.Event()
            hostile = [asyncio.create_task(hostile_rounds(c, stop, pause=0.3)) for c in (ca, cb)]
            loads = [
                asyncio.create_task(run_workload(c, requests=48, concurrency=4, seed=seed))
                for c, seed in ((ca, 31), (cb, 32))
            ]
            await asyncio.sleep(at)
            assert not all(load.done() for load in loads), "the load ended before the kill"
            mooncake_master.kill()
            killed = time.monotonic()
            gathered = asyncio.gather(*loads)
            queried = await queried_once_down(gathered)
            tallies = await asyncio.wait_for(gathered, 120)
            ended = time.monotonic() - killed
            stop.set()
            return tallies, [s for h in hostile for s in await h], ended, queried

    tallies, hostile, ended, queried = asyncio.run(run())
    try:
        for tally in tallies:
            assert not tally.errors, tally.errors[:5]
        # the rest of the load recomputed at once: nothing was queried once it was down
        assert None not in queried, f"an engine saw no L3 failure while the load ran: {queried}"
        assert [failures_and_queries(e.url)[1] for e in (a, b)] == queried
        assert hostile and all(s == 400 for _, s in hostile), hostile[:10]
        wait_clean([a, b])
        ids = prompt(11, 57)
        want = hf_greedy(str(checkpoint), tuple(ids), MAX_TOKENS)[0]
        assert generate(a.url, ids)["output_ids"] == want
        assert generate(b.url, ids)["output_ids"] == want
        after = metric(a.url, "l3_failures_total") + metric(b.url, "l3_failures_total")
        wait_clean([a, b])
    finally:
        mooncake_master.restart()
    outcomes = tallies[0].outcomes + tallies[1].outcomes
    print(
        f"reliability: mooncake master killed {at:.2f} s into the load: {dict(outcomes)} "
        f"hostile={len(hostile)} l3 failures +{after - failures:.0f}; "
        f"requests ended {ended:.2f} s after the kill"
    )
    bound = FLAGS["kvstore_storage_timeout"] + ENDED_SLACK
    assert ended <= bound, f"the last request ended {ended:.2f} s after the kill (> {bound} s)"
