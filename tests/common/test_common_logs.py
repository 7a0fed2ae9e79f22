"""Structured logs: JSON lines, and the request id on what is logged while a request is handled.

The RPC server and the streaming peers set the request id of the message they dispatch (real
ZeroMQ sockets here), so a handler's lines -- and those of the task that answers later -- carry it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import pytest
from yutu.logs import REQUEST_ID, JsonFormatter, RequestIdFilter, about, setup_logging
from yutu.protocol.codec import Channel
from yutu.rpc import RpcClient, RpcServer

TRACED = Channel("logs-test", version=1)


@TRACED.message("work")
@dataclass
class Work:
    request_id: str
    later: bool = False


@TRACED.message("done")
@dataclass
class Done:
    request_id: str


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.addFilter(RequestIdFilter())
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, object]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


def test_a_json_line_has_the_fields_and_the_request_of_its_context() -> None:
    handler = Collect()
    log = logging.getLogger("yutu.test.logs")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        log.info("outside %d", 1)
        with about(Work("cmpl-7")):
            log.warning("inside")
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("failed")
        with about(object()):  # nothing to name: unchanged
            log.info("still outside")
    finally:
        log.removeHandler(handler)
    first, inside, failed, last = handler.lines
    assert first["message"] == "outside 1" and "request_id" not in first
    assert set(first) == {"ts", "level", "logger", "pid", "message"} and first["level"] == "info"
    assert str(first["ts"]).endswith("Z") and first["logger"] == "yutu.test.logs"
    assert inside["request_id"] == "cmpl-7" and inside["level"] == "warning"
    assert failed["request_id"] == "cmpl-7" and "ValueError: boom" in str(failed["exc"])
    assert "request_id" not in last and REQUEST_ID.get() is None


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="choose one of text, json"):
        setup_logging("info", "yaml")


async def test_rpc_handlers_log_with_the_request_id_of_their_message() -> None:
    handler = Collect()
    log = logging.getLogger("yutu.test.rpc")
    log.addHandler(handler)
    log.setLevel(logging.INFO)

    async def answer_later(msg: Work) -> Done:
        await asyncio.sleep(0.01)
        log.info("answered later")
        return Done(msg.request_id)

    def handle(msg: Work) -> Done | asyncio.Task[Done]:
        log.info("handling")
        return asyncio.ensure_future(answer_later(msg)) if msg.later else Done(msg.request_id)

    server = RpcServer(TRACED, handle)
    server.start()
    client = RpcClient(TRACED, server.endpoint, timeout_s=5)
    try:
        assert (await client.call(Work("r-now"))).request_id == "r-now"
        assert (await client.call(Work("r-later", later=True))).request_id == "r-later"
    finally:
        await client.close()
        await server.close()
        log.removeHandler(handler)
    assert [(line["message"], line.get("request_id")) for line in handler.lines] == [
        ("handling", "r-now"),
        ("handling", "r-later"),
        ("answered later", "r-later"),
    ]
