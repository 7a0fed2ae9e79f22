"""Error kinds shared by every service.

Each kind maps to one HTTP status and one OpenAI error ``type`` at the gateway edge, so a worker, the
conductor or the store can raise a typed error and the client sees a precise, actionable message.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorKind(StrEnum):
    INVALID_REQUEST = "invalid_request_error"  # 400: the caller must change the request
    NOT_FOUND = "not_found_error"  # 404: unknown model, key or resource
    TOO_LARGE = "request_too_large"  # 413: a request body, or a stored object, larger than allowed
    OVERLOADED = "overloaded_error"  # 429: try again later (with Retry-After)
    UNAVAILABLE = "service_unavailable"  # 503: no instance can take the request now
    INTERNAL = "internal_error"  # 500: a bug or a failure we did not expect

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]


_HTTP_STATUS = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
}


class YutuError(Exception):
    """An error with a kind; ``str(err)`` is the message shown to the user."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str, kind: ErrorKind | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class OverloadedError(YutuError):
    """Too much load to take the request now (HTTP 429); ``retry_after_s`` says when to try again."""

    kind = ErrorKind.OVERLOADED

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = max(1.0, retry_after_s)


class StartupError(Exception):
    """A service cannot start as configured (its --model cannot be read, its port is taken, Redis
    does not answer, ...): the process logs the message alone, no traceback, and exits 1."""


class BindError(StartupError, OSError):
    """A listening socket could not be bound (its port taken, its address not this host's); still
    an OSError for callers that catch one."""
