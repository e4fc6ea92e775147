"""The HTTP/1.1 connection: uvicorn's httptools protocol with the limits a server facing
untrusted clients needs, enforced on the raw bytes before anything is buffered.

* the request head (request line and headers) is at most ``max_head_bytes`` (431), with
  at most ``max_headers`` headers (431) and a URL of at most ``max_url_bytes`` (414);
* the head must arrive within ``head_timeout`` seconds of the connection opening, or of
  the previous response ending (a partial head is answered 408; a connection that sent
  nothing is closed) -- so idle and stalled connections do not hold descriptors;
* at most ``max_connections`` connections are open; one more is answered 503 and closed;
* the parser's own 400 (malformed HTTP) is an OpenAI-style JSON body too;
* a streamed response's socket send buffer is ``stream_send_buffer`` bytes, not the
  kernel's autotuned one (up to megabytes), and its transport pauses the writer as soon
  as the socket refuses a write (no 64 KiB of small chunks queued in the transport): a
  client that stops reading stops the writer within that, and the server's own bound on
  a stream's backlog applies (``STREAM_EXTENSION``: the response calls it as it starts).

Every refusal closes the connection: the rest of what the client sends is not read.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from dataclasses import dataclass

import httptools
import msgspec
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from tokenspeed_aio.server.errors import error_payload

HEAD_END = b"\r\n\r\n"
# scope["extensions"][STREAM_EXTENSION](): a streamed response starts on this connection.
STREAM_EXTENSION = "tokenspeed.stream"


@dataclass(frozen=True)
class ConnectionLimits:
    max_head_bytes: int = 64 * 1024
    max_headers: int = 100
    max_url_bytes: int = 16 * 1024
    head_timeout: float = 10.0
    max_connections: int = 4096
    max_body_bytes: int = 8 * 1024 * 1024  # named by the refusal of an overflowing length
    stream_send_buffer: int = 64 * 1024  # SO_SNDBUF of a streaming response; 0: the kernel's


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def refusal_bytes(status: int, message: str, code: str | None) -> bytes:
    """A complete ``Connection: close`` response with an OpenAI error body."""
    body = msgspec.json.encode(error_payload(status, message, code=code))
    return b"".join(
        (
            STATUS_LINE[status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        )
    )


class GuardedProtocol(HttpToolsProtocol):
    limits = ConnectionLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0  # bytes of the current request head seen so far
        self._in_head = True
        self._tail = b""  # the last bytes seen, to find a head end split across reads
        self._header_count = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._last_refusal: _Refused | None = None
        if len(self.connections) > self.limits.max_connections:
            self._refuse(
                503,
                f"too many open connections: the limit is {self.limits.max_connections} "
                "(--max-connections); retry later",
                "too_many_connections",
            )
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            room = self.limits.max_head_bytes - self._head_bytes
            if len(data) > room and HEAD_END not in self._tail + data[: max(room, 0) + 4]:
                self._refuse(
                    431,
                    f"the request head (request line and headers) is larger than "
                    f"{self.limits.max_head_bytes} bytes (--max-header-bytes)",
                    "request_header_too_large",
                )
                return
            self._head_bytes += len(data)
            self._tail = data[-3:]
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as err:
            # A callback's refusal reaches here as the parser's error (httptools wraps it).
            refused, self._last_refusal = self._last_refusal, None
            if refused is not None:
                self._refuse(refused.status, refused.message, refused.code)
            elif "Content-Length overflow" in str(err):
                self._refuse(
                    413,
                    "Content-Length header: the value does not fit in 64 bits; the limit is "
                    f"{self.limits.max_body_bytes} bytes (--max-body-bytes)",
                    "request_too_large",
                )
            else:
                self._refuse(400, f"malformed HTTP request: {err}", "invalid_http")

    # -- parser callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0
        self.scope["extensions"] = {STREAM_EXTENSION: self._streaming}

    def _streaming(self) -> None:
        """Bound the send buffer (Linux doubles the value for its bookkeeping), and pause
        the writer as soon as the socket refuses a write: the transport's own buffer then
        holds one chunk, and the rest of a slow reader's backlog stays in the stream's
        buffer, where its bound counts it."""
        sock = self.transport.get_extra_info("socket")
        if self.limits.stream_send_buffer and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.stream_send_buffer)
            self.transport.set_write_buffer_limits(high=0)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_url_bytes:
            self._last_refusal = _Refused(
                414,
                f"the URL is longer than {self.limits.max_url_bytes} bytes (--max-url-bytes)",
                "uri_too_long",
            )
            raise self._last_refusal

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._last_refusal = _Refused(
                431,
                f"the request has more than {self.limits.max_headers} headers (--max-header-count)",
                "too_many_headers",
            )
            raise self._last_refusal
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._in_head, self._head_bytes, self._tail = True, 0, b""
            self._arm_head_timer()

    # -- helpers ---------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        if self._head_bytes == 0:  # idle: nothing to answer
            self.transport.close()
            return
        self._refuse(
            408,
            f"the request head did not arrive within {self.limits.head_timeout:g} s "
            "(--header-timeout)",
            "request_timeout",
        )

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._cancel_head_timer()
        self._in_head = False
        if not self.transport.is_closing():
            self.transport.write(refusal_bytes(status, message, code))
            self.transport.close()


@functools.cache
def protocol_class(limits: ConnectionLimits) -> type[GuardedProtocol]:
    """A GuardedProtocol subclass bound to ``limits`` (uvicorn takes a class)."""
    return type("LimitedProtocol", (GuardedProtocol,), {"limits": limits})
