"""The bootstrap server a prefill engine runs on its first rank
(``--disaggregation-bootstrap-port``): the engine's ranks register their control
endpoints, transfer sessions and KV layouts; a decode rank that got a request naming
this server (the gateway's ``bootstrap_host``/``bootstrap_port``) looks them up."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from tokenspeed_aio.pd.framing import read_frame, write_frame
from tokenspeed_aio.pd.messages import Lookup, RankEndpoint, RegisterRank, Roster
from tokenspeed_aio.pd.peer import CONNECT_SECONDS, PeerError

logger = logging.getLogger(__name__)


class BootstrapServer:
    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self.ranks: dict[int, RankEndpoint] = {}
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, host, port)
        except OSError as err:
            raise RuntimeError(
                f"the bootstrap server could not listen on {host}:{port} ({err}); "
                "choose another --disaggregation-bootstrap-port"
            ) from err

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                msg = await read_frame(reader, "bootstrap")
                if isinstance(msg, RegisterRank):
                    self.ranks[msg.endpoint.tp_rank] = msg.endpoint
                    write_frame(writer, Roster([]))
                elif isinstance(msg, Lookup):
                    write_frame(writer, self.roster())
                await writer.drain()
        except (ConnectionError, OSError) as err:  # a rank or decode engine went away
            logger.debug("bootstrap connection closed: %s", err)
        finally:
            writer.close()

    def roster(self) -> Roster:
        if len(self.ranks) < self.tp_size:
            return Roster([], "the prefill engine's ranks are still starting")
        return Roster([self.ranks[r] for r in range(self.tp_size)])


async def _ask(host: str, port: int, message) -> Roster:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port), timeout=CONNECT_SECONDS
    )
    try:
        write_frame(writer, message)
        await writer.drain()
        reply = await asyncio.wait_for(read_frame(reader, "bootstrap"), CONNECT_SECONDS)
    finally:
        writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await writer.wait_closed()
    if not isinstance(reply, Roster):
        raise ConnectionError(f"{host}:{port} is not a bootstrap server")
    return reply


async def register_rank(host: str, port: int, endpoint: RankEndpoint, timeout: float) -> None:
    """Register a prefill rank, retrying while the first rank's server starts."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await _ask(host, port, RegisterRank(endpoint))
            return
        except (OSError, ConnectionError, TimeoutError) as err:
            if loop.time() > deadline:
                raise RuntimeError(
                    f"rank {endpoint.tp_rank} could not register at the bootstrap server "
                    f"{host}:{port}: {err}"
                ) from err
            await asyncio.sleep(0.1)


async def lookup(host: str, port: int) -> list[RankEndpoint]:
    """The prefill engine's ranks; PeerError when its bootstrap server cannot be asked."""
    try:
        roster = await _ask(host, port, Lookup())
    except (OSError, ConnectionError, TimeoutError) as err:
        raise PeerError(
            503, f"cannot reach the prefill engine's bootstrap server at {host}:{port}: {err}"
        ) from err
    if roster.error is not None:
        raise PeerError(503, f"the prefill engine at {host}:{port}: {roster.error}")
    return roster.ranks
