"""The OpenAI error envelope and the exception handlers that produce it.

Every error the gateway returns, whatever raised it, has the body::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

``type`` is the :class:`~yutu.errors.ErrorKind` value (one HTTP status per kind), except for
authentication (401, ``authentication_error``) which has no kind of its own. Schema validation
failures (wrong types, out-of-range values) and invalid JSON are 400 ``invalid_request_error``, the
way OpenAI and vLLM answer them, with ``param`` naming the offending field.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from yutu.errors import ErrorKind, OverloadedError, YutuError

log = logging.getLogger(__name__)

AUTHENTICATION_ERROR = "authentication_error"


class ApiError(Exception):
    """An error answered to the client with the envelope; ``str(err)`` is the message."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = ErrorKind.INVALID_REQUEST.value,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    @classmethod
    def of_kind(
        cls, kind: ErrorKind, message: str, param: str | None = None, code: str | None = None
    ) -> ApiError:
        return cls(message, kind.http_status, kind.value, param, code)

    @classmethod
    def from_yutu(cls, exc: YutuError) -> ApiError:
        err = cls.of_kind(exc.kind, str(exc))
        if isinstance(exc, OverloadedError):  # 429: say when to come back
            err.headers = {"Retry-After": str(math.ceil(exc.retry_after_s))}
        return err

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def context_length_exceeded(message: str, param: str) -> ApiError:
    """A prompt, or a prompt with its max_tokens, that does not fit the model's context: 400
    ``invalid_request_error`` with code ``context_length_exceeded``, as OpenAI and vLLM answer it
    (OpenAI's clients raise ``BadRequestError``; callers that trim and retry look for the code)."""
    return ApiError.of_kind(ErrorKind.INVALID_REQUEST, message, param, code="context_length_exceeded")


def invalid(message: str, param: str | None = None) -> ApiError:
    """A 400 for a request the caller must change."""
    return ApiError.of_kind(ErrorKind.INVALID_REQUEST, message, param)


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return invalid(f"the request body is not valid JSON ({detail}): send a JSON object")
    return validation_failed(errors)


def validation_failed(errors: Sequence[Any], prefix: Sequence[str] = ()) -> ApiError:
    """The 400 of pydantic's ``errors`` for a part of the request at ``prefix`` (its field path):
    every field named, the first one the ``param``."""
    parts: list[str] = []
    param: str | None = None
    for err in errors:
        loc = [*prefix, *_field_path(err.get("loc", ()))]
        where = ".".join(loc) if loc else "body"
        if param is None and loc:
            param = where
        part = f"{where}: {_message(err)}"
        if part not in parts:
            parts.append(part)
    return invalid("invalid request: " + "; ".join(parts), param)


_BOUNDS = {  # pydantic error type -> (operator, ctx key of the bound)
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def _message(err: Any) -> str:
    """pydantic's message, except that a numeric bound is written as Python writes the number
    (``must be >= 1.401298464324817e-45``, not a 45-digit decimal)."""
    bound = _BOUNDS.get(str(err.get("type")))
    if bound is not None:
        op, key = bound
        value = (err.get("ctx") or {}).get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return f"must be {op} {value!r}, got {err.get('input')!r}"
    return str(err.get("msg", "invalid value"))


def _field_path(loc: tuple[int | str, ...] | list[int | str]) -> list[str]:
    """The field path of a pydantic error location, without "body" and union member tags."""
    path: list[str] = []
    for item in loc:
        if item == "body" and not path:
            continue
        if isinstance(item, str) and (not item.isidentifier() or item in _TYPE_TAGS):
            break  # "str", "list[int]", "function-after[...]": which union member failed
        path.append(str(item))
    return path


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise through the envelope."""

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(YutuError)
    async def on_yutu_error(request: Request, exc: YutuError) -> JSONResponse:
        return ApiError.from_yutu(exc).response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(json.JSONDecodeError)
    async def on_json_error(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return invalid(f"the request body is not valid JSON ({exc}): send a JSON object").response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: ErrorKind.NOT_FOUND.value, 503: ErrorKind.UNAVAILABLE.value}.get(
            exc.status_code, ErrorKind.INVALID_REQUEST.value
        )
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (
                f"no route {request.method} {request.url.path}: this server answers /v1/models,"
                " /v1/completions, /v1/chat/completions, /tokenize, /detokenize, /health, /ready, /metrics"
            )
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(
            error_body(message, kind), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError.of_kind(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}: {exc}").response()
