"""Errors of the HTTP client: each carries what the server said (status and its
OpenAI-style error message) or why the server could not be reached."""

from __future__ import annotations

import msgspec

from tokenspeed_aio.protocol.openai import ErrorDetail, ErrorResponse


class ClientError(Exception):
    """Base class of the client's errors."""


class APIConnectionError(ClientError):
    """The server could not be reached (after the retries)."""


class APIStatusError(ClientError):
    """The server answered with an error status."""

    def __init__(self, status: int, detail: ErrorDetail) -> None:
        super().__init__(f"HTTP {status}: {detail.message}")
        self.status = status
        self.message = detail.message
        self.type = detail.type
        self.param = detail.param
        self.code = detail.code


class StreamError(ClientError):
    """The server sent an error event in the middle of a stream."""

    def __init__(self, detail: ErrorDetail) -> None:
        super().__init__(detail.message)
        self.message = detail.message
        self.type = detail.type
        self.param = detail.param
        self.code = detail.code


def error_detail(body: bytes | str) -> ErrorDetail | None:
    """The OpenAI error in ``body``, if it is one."""
    try:
        return msgspec.json.decode(body, type=ErrorResponse).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def status_error(status: int, body: bytes, reason: str) -> APIStatusError:
    detail = error_detail(body)
    if detail is None:  # not our server's body (a proxy's page, say): keep its start
        text = body[:500].decode("utf-8", "replace") or reason
        detail = ErrorDetail(message=text, type="http_error")
    return APIStatusError(status, detail)
