"""A streamed response: an async iterator of typed chunks read from server-sent
events, closed (and with it the HTTP connection, which aborts the request on the
server) when iteration ends, breaks inside ``async with``, or ``aclose()``."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, AsyncIterable
from typing import Generic, TypeVar

import httpx
import msgspec

from tokenspeed_aio.client.errors import StreamError, error_detail

T = TypeVar("T")


class Stream(Generic[T]):
    """``async for chunk in stream``; use ``async with stream:`` (or ``aclose()``) when
    you may stop early, so the server stops generating at once."""

    def __init__(self, response: httpx.Response, kind: type[T]) -> None:
        self.response = response
        self._chunks = self._read(kind)

    def __aiter__(self) -> Stream[T]:
        return self

    async def __anext__(self) -> T:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()
        await self.response.aclose()

    async def __aenter__(self) -> Stream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _read(self, kind: type[T]) -> AsyncGenerator[T, None]:
        decoder = msgspec.json.Decoder(kind)
        try:
            async for line in event_stream_lines(self.response.aiter_bytes()):
                if not line.startswith("data:"):
                    continue  # blank separators, comments, other SSE fields
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    yield decoder.decode(data)
                except msgspec.ValidationError:
                    detail = error_detail(data)
                    if detail is None:
                        raise
                    raise StreamError(detail) from None
        finally:
            await self.response.aclose()


_LINE_END = re.compile(rb"\r\n|\r|\n")


async def event_stream_lines(chunks: AsyncIterable[bytes]) -> AsyncGenerator[str, None]:
    """The lines of an event stream as its specification ends them: at CRLF, LF or CR only.
    ``str.splitlines`` (and httpx's ``aiter_lines``) also end lines at U+0085, U+2028 and
    U+2029, which JSON carries unescaped inside strings. Split as bytes, a line never cuts a
    UTF-8 character: none of its bytes is a CR or an LF."""
    pending = b""
    async for chunk in chunks:
        data = pending + chunk
        # A CR that ends the data may be the first half of a CRLF: held for the next chunk.
        cut = len(data) - 1 if data.endswith(b"\r") else len(data)
        *lines, pending = _LINE_END.split(data[:cut])
        pending += data[cut:]
        for line in lines:
            yield line.decode()
    if pending:  # the last line, unterminated or ended by a lone CR
        yield pending.removesuffix(b"\r").decode()
