"""Errors the engine reports to its callers, each with the HTTP status it maps to."""

from __future__ import annotations


class EngineError(Exception):
    """Base class. ``status`` is the HTTP status the server answers with."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (a field out of range, a prompt too long)."""

    status = 400
    code = "invalid_request_error"


class RequestConflictError(EngineError):
    """The request id is still held by the engine (the design's 409 window)."""

    status = 409
    code = "conflict"


class CapacityError(EngineError):
    """The request can never fit the engine's KV cache, or the engine is overloaded."""

    status = 503
    code = "capacity_error"


class EngineDeadError(EngineError):
    """The engine stopped; no request can be served."""

    status = 503
    code = "engine_dead"


STATUS_ERRORS: dict[int, type[EngineError]] = {
    400: InvalidRequestError,
    409: RequestConflictError,
    503: CapacityError,
}


def error_from_status(status: int, message: str, param: str | None = None) -> EngineError:
    """Rebuild an error that crossed the wire as (status, message)."""
    cls = STATUS_ERRORS.get(status, EngineError)
    err = cls(message, param=param)
    err.status = status
    return err
