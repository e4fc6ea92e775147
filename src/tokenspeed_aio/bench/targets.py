"""What a benchmark drives: an in-process AsyncEngine, or a running server over HTTP.

Both stream a request's tokens as they are produced (TTFT and ITL are measured at
the consumer), greedy and with ``ignore_eos`` so every reply has exactly the length
the workload asked for. Only the in-process engine can show its control plane's
per-round timings.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.control.round_stats import RoundSample
from tokenspeed_aio.sampling_params import SamplingParams


@dataclass(slots=True)
class Chunk:
    new_ids: list[int]  # tokens new in this streamed output (may be empty)
    cached_tokens: int  # prompt tokens served from the prefix cache, as reported so far


class Target(Protocol):
    kind: str  # "engine" | "server"

    def stream(self, prompt_ids: list[int], output_len: int) -> AsyncIterator[Chunk]:
        """The request's outputs as they arrive."""
        ...

    def round_mark(self) -> int | None:
        """A position in the control plane's round samples (None: not observable)."""
        ...

    def rounds_since(self, mark: int | None) -> list[RoundSample] | None:
        """The rounds with device work since ``mark`` (None: not observable)."""
        ...

    async def settle(self) -> None:
        """Wait until nothing of the last run is still held, before the next one."""
        ...

    async def forward_timeline(self) -> dict[str, float] | None:
        """Device busy/idle ms over the forwards since the last call (None: unknown)."""
        ...

    async def close(self) -> None: ...


def greedy(output_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)


class EngineTarget:
    """An AsyncEngine in this process: its control plane is a task of this event loop."""

    kind = "engine"

    def __init__(self, engine) -> None:
        self.engine = engine

    @classmethod
    async def start(cls, args: EngineArgs) -> EngineTarget:
        from tokenspeed_aio.api.engine import AsyncEngine

        return cls(await AsyncEngine.start(args))

    async def stream(self, prompt_ids: list[int], output_len: int) -> AsyncIterator[Chunk]:
        params = greedy(output_len)
        async for out in self.engine.generate(prompt_token_ids=prompt_ids, sampling_params=params):
            yield Chunk(out.delta_token_ids, out.num_cached_tokens)

    def _samples(self):
        loop = self.engine.control_loop
        return loop.stats.samples if loop is not None else None

    def round_mark(self) -> int | None:
        samples = self._samples()
        return None if samples is None else len(samples)

    def rounds_since(self, mark: int | None) -> list[RoundSample] | None:
        samples = self._samples()
        if samples is None or mark is None:
            return None
        # NOTE: the stats keep the last 100k rounds; a run longer than that loses its
        # oldest rounds here (the count is in the report).
        return list(islice(samples, min(mark, len(samples)), None))

    async def settle(self) -> None:
        await self.engine.wait_idle(timeout=60.0)

    async def forward_timeline(self) -> dict[str, float] | None:
        loop = self.engine.control_loop
        return None if loop is None else await loop.data_plane.forward_timeline()

    async def close(self) -> None:
        await self.engine.shutdown()


class ServerTarget:
    """A running server, through AsyncClient and SGLang's streamed ``/generate`` (it takes
    token ids and streams the ids generated so far)."""

    kind = "server"

    def __init__(self, url: str, api_key: str | None = None) -> None:
        from tokenspeed_aio.client import AsyncClient

        self.url = url
        self.client = AsyncClient(url, api_key, max_retries=0)

    async def stream(self, prompt_ids: list[int], output_len: int) -> AsyncIterator[Chunk]:
        params: dict[str, Any] = {
            "max_new_tokens": output_len,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        stream = await self.client.generate(
            input_ids=prompt_ids, sampling_params=params, stream=True
        )
        seen = 0
        async with stream:
            async for result in stream:
                ids = result.output_ids
                yield Chunk(ids[seen:], result.meta_info.cached_tokens)
                seen = len(ids)

    def round_mark(self) -> int | None:
        return None

    def rounds_since(self, mark: int | None) -> list[RoundSample] | None:
        return None

    async def settle(self) -> None:
        return None

    async def forward_timeline(self) -> dict[str, float] | None:
        return None  # the rank's device timeline is not on the wire

    async def close(self) -> None:
        await self.client.aclose()
