"""Logging of every Yutu process: text for a terminal, or one JSON object per line (``--log-format json``).

A JSON line holds ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``pid``, ``message``, ``exc`` (a
traceback, when there is one) and ``request_id`` when the line is about a request: the gateway sets
:data:`REQUEST_ID` to the request's ``x-request-id`` for everything it logs while serving it, and
logs once which internal id (``cmpl-...``) it gave the request; that internal id travels with every
control message (placement, prefill, decode), and the services set :data:`REQUEST_ID` to it while
handling one, so ``request_id`` joins a request's lines across processes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"

REQUEST_ID: ContextVar[str | None] = ContextVar("yutu_request_id", default=None)


@contextmanager
def about(msg: Any) -> Iterator[None]:
    """While handling ``msg``: :data:`REQUEST_ID` is its ``request_id`` (when it has a str one), so
    what the handler logs -- and every task it starts -- names the request."""
    request_id = getattr(msg, "request_id", None)
    if not isinstance(request_id, str):
        yield
        return
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    """Puts the current :data:`REQUEST_ID` on every record (``record.request_id``, None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            out["request_id"] = request_id
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger once for this process: ``level`` by name, ``fmt`` one of FORMATS."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: choose one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def current_settings() -> tuple[str, str]:
    """(level, format) of this process's logging as ``setup_logging`` left it, for a child process
    to log the same way."""
    root = logging.getLogger()
    fmt = "json" if any(isinstance(h.formatter, JsonFormatter) for h in root.handlers) else "text"
    return logging.getLevelName(root.level).lower(), fmt
