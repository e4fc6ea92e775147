"""How a prefill engine learns that a decode rank is gone, against the suite's spare
prefill engine P2 with the decode rank played over the real control protocol (TCP, the
project's frames), so the test chooses when it goes silent or hangs up: a room a decode
rank held fails once its connection drops, or once its heartbeat lapses while the
connection stays open; pings keep a held room waiting; after such a loss a room no
decode rank holds fails within HOLD_SECONDS instead of the bootstrap timeout; a decode
rank of another protocol version is refused with both versions named."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import pytest

from pd.harness import BOOTSTRAP_TIMEOUT, scrape, wait_clean
from pd.workload import PROMPTS, completion
from tokenspeed_aio.pd.bootstrap import lookup
from tokenspeed_aio.pd.framing import read_frame, write_frame
from tokenspeed_aio.pd.messages import CONTROL_VERSION, Hello, Hold, Ping, Welcome
from tokenspeed_aio.pd.peer import HEARTBEAT_LAPSE_SECONDS, HEARTBEAT_SECONDS, new_instance
from tokenspeed_aio.pd.sender import HOLD_SECONDS

pytestmark = pytest.mark.timeout(300)


class DecodeRank:
    """A decode rank's control connection to the prefill engine's rank 0."""

    def __init__(self, prefill, version: int = CONTROL_VERSION) -> None:
        self.prefill = prefill
        self.version = version

    async def __aenter__(self) -> DecodeRank:
        (rank,) = await lookup("127.0.0.1", self.prefill.bootstrap_port)
        self.reader, self.writer = await asyncio.open_connection(rank.host, rank.port)
        hello = Hello(new_instance(), 0, "127.0.0.1:1", rank.layout, self.version)
        self.send(hello)
        self.welcome = await asyncio.wait_for(read_frame(self.reader, "control"), 10)
        assert isinstance(self.welcome, Welcome)
        return self

    async def __aexit__(self, *exc) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await self.writer.wait_closed()

    def send(self, message) -> None:
        write_frame(self.writer, message)

    async def ping_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.send(Ping())
            await self.writer.drain()
            await asyncio.sleep(HEARTBEAT_SECONDS)


def prefill_half(prefill, room: int):
    """The prefill half of a request for ``room``, as the gateway sends it (in a thread)."""
    bootstrap = dict(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port)
    return asyncio.to_thread(completion, prefill.url, PROMPTS[1], bootstrap_room=room, **bootstrap)


def in_flight(engine) -> float:
    return scrape(engine.url).get("tokenspeed:pd_rooms_in_flight", 0)


async def until_in_flight(engine, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(in_flight, engine):
        assert time.monotonic() < deadline, "the prefill half never registered"
        await asyncio.sleep(0.05)


def failed_within(response, since: float, low: float, high: float, words: str) -> float:
    elapsed = time.monotonic() - since
    assert response.status_code == 503, response.text
    assert words in response.json()["error"]["message"], response.text
    assert low <= elapsed < high, elapsed
    return elapsed


def test_a_held_room_fails_when_the_decode_rank_hangs_up(deployment):
    prefill = deployment.engines["P2"]
    room = random.getrandbits(62)

    async def run() -> None:
        async with DecodeRank(prefill) as decode:
            assert decode.welcome.error is None
            assert decode.welcome.version == CONTROL_VERSION
            decode.send(Hold(room))
            half = asyncio.create_task(prefill_half(prefill, room))
            await until_in_flight(prefill)
            # pinged for longer than the lapse, the held room still waits for its claim
            await decode.ping_for(HEARTBEAT_LAPSE_SECONDS + 1.5)
            assert not half.done() and await asyncio.to_thread(in_flight, prefill)
        hung_up = time.monotonic()
        failed_within(await half, hung_up, 0, 2, "lost the decode engine's connection")

        # for a while after that loss, a room no decode rank holds fails fast
        unheld = asyncio.create_task(prefill_half(prefill, room + 1))
        await until_in_flight(prefill)
        sent = time.monotonic()
        elapsed = failed_within(
            await unheld, sent, HOLD_SECONDS - 1, HOLD_SECONDS + 2, "no decode engine took"
        )
        assert elapsed < BOOTSTRAP_TIMEOUT / 2

    asyncio.run(run())
    wait_clean([prefill], timeout=10)


def test_a_held_room_fails_when_the_decode_ranks_heartbeat_lapses(deployment):
    prefill = deployment.engines["P2"]
    room = random.getrandbits(62)

    async def run() -> None:
        async with DecodeRank(prefill) as decode:
            decode.send(Hold(room))
            await decode.writer.drain()
            held = time.monotonic()
            half = asyncio.create_task(prefill_half(prefill, room))
            # silent from here on, the connection left open
            response = await half
            failed_within(
                response,
                held,
                HEARTBEAT_LAPSE_SECONDS - 0.5,
                HEARTBEAT_LAPSE_SECONDS + 3,
                f"no heartbeat for {HEARTBEAT_LAPSE_SECONDS:g} s",
            )
            # the prefill rank hung up on it
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(read_frame(decode.reader, "control"), 5)

    asyncio.run(run())
    wait_clean([prefill], timeout=10)


def test_a_decode_rank_of_another_protocol_version_is_refused(deployment):
    async def run() -> str | None:
        async with DecodeRank(deployment.engines["P2"], version=0) as decode:
            assert decode.welcome.version == CONTROL_VERSION
            return decode.welcome.error

    error = asyncio.run(run())
    assert error is not None
    assert f"protocol 0, this prefill engine {CONTROL_VERSION}" in error, error
