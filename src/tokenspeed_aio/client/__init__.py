"""An asyncio client for a running tokenspeed_aio server (``python -m tokenspeed_aio
serve``). The official ``openai`` package works against the server too."""

from tokenspeed_aio.client.client import AsyncClient, Health
from tokenspeed_aio.client.errors import (
    APIConnectionError,
    APIStatusError,
    ClientError,
    StreamError,
)
from tokenspeed_aio.client.stream import Stream
from tokenspeed_aio.protocol.openai import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelList,
    Usage,
)
from tokenspeed_aio.protocol.sglang import GenerateResult

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "AsyncClient",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ClientError",
    "Completion",
    "GenerateResult",
    "Health",
    "ModelList",
    "Stream",
    "StreamError",
    "Usage",
]
