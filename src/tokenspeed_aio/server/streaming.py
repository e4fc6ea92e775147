"""Server-sent events and client disconnects.

uvicorn's h11 protocol drops writes to a closed connection silently, so a
streaming endpoint never learns from ``send`` that its client left. Both helpers
here therefore watch ``receive`` for ``http.disconnect`` beside the work, and
cancel the work when it comes: cancellation closes the generate() streams, and
closing a stream aborts its engine request (freeing its KV blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.responses import Response

from tokenspeed_aio.server.http_protocol import STREAM_EXTENSION

T = TypeVar("T")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
]
DONE = b"data: [DONE]\n\n"


# Line breaks to str.splitlines() but not to SSE (U+0085, U+2028, U+2029), which JSON
# leaves unescaped: escaped, so a client that splits the stream into lines with it
# (httpx's aiter_lines; AsyncClient splits at the SSE line ends) never cuts a payload. In
# UTF-8 these byte sequences can only be those characters, inside JSON strings.
_SPLITLINES_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def sse_event(payload: Any) -> bytes:
    """One ``data: {...}`` event of a msgspec-encodable payload."""
    data = msgspec.json.encode(payload)
    for raw, escaped in _SPLITLINES_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


class ClientDisconnected(Exception):
    """The client closed its connection before the response was complete."""


async def _wait_for_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass  # a late body chunk: the body was already read, keep waiting


async def cancel_on_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Run ``work``; if the client disconnects first, cancel it and raise
    ClientDisconnected (the guard answers nothing: nobody is listening)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # a no-op when it finished first
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


class EventStream(Response):
    """A ``text/event-stream`` response of pre-encoded events that stops, and closes its
    source, as soon as the client disconnects. ``on_close`` runs when the response is done,
    whether or not its source ever started (a client gone before the first event)."""

    def __init__(
        self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None] | None = None
    ) -> None:
        super().__init__(status_code=200)
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        started = scope.get("extensions", {}).get(STREAM_EXTENSION)
        if started is not None:  # the connection bounds its send buffer
            started()
        streamer = asyncio.create_task(self._stream(send))
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streamer, watcher):
                t.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            if self.on_close is not None:
                self.on_close()
        if not streamer.cancelled() and streamer.exception() is not None:
            exc = streamer.exception()
            if not isinstance(exc, OSError):  # OSError: the client went away mid-write
                raise exc

    async def _stream(self, send: Callable) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        finally:
            # NOTE: a cancelled stream may be suspended at a yield (inside send); close it
            # here so the generate() streams behind it abort now, not at garbage collection.
            await self.events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
