"""Codec, RPC and registry against real sockets and a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import pytest
from yutu.errors import ErrorKind, YutuError
from yutu.protocol.codec import Channel, ProtocolError
from yutu.protocol.generate import CHANNEL as GENERATE
from yutu.protocol.generate import GenerateRequest, TokenDelta, TokenDeltas
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.rpc import RpcClient, RpcServer

ECHO = Channel("echo-test", version=3)


@ECHO.message("ask")
@dataclass
class Ask:
    text: str
    fail: str | None = None


@ECHO.message("answer")
@dataclass
class Answer:
    text: str


def test_codec_round_trip_and_refusals() -> None:
    msg = GenerateRequest("r1", [1, 2, 3], {"temperature": 0.0}, 12.5)
    assert GENERATE.decode(GENERATE.encode(msg)) == msg
    delta = TokenDelta("r1", [7], [[7, -0.5, [[7, -0.5], [9, -1.0]]]], "stop", 3, 0)
    assert GENERATE.decode(GENERATE.encode(delta)) == delta
    other = TokenDelta("r2", [8, 9], None, None, 5, 4)
    batch = GENERATE.decode(GENERATE.encode(TokenDeltas.of([delta, other])))
    assert isinstance(batch, TokenDeltas) and batch.unpack() == [delta, other]
    with pytest.raises(ProtocolError, match="malformed TokenDeltas row"):
        TokenDeltas([[*TokenDeltas.of([delta]).rows[0]], ["r3", [1]]]).unpack()
    with pytest.raises(ProtocolError, match="channel 'generate' received on 'echo-test'"):
        ECHO.decode(GENERATE.encode(msg))
    with pytest.raises(ProtocolError, match="version 2 received, this process speaks 3"):
        ECHO.decode(msgpack.packb(["echo-test", 2, "ask", {"text": "x"}]))
    with pytest.raises(ProtocolError, match="unknown message 'nope'"):
        ECHO.decode(msgpack.packb(["echo-test", 3, "nope", {}]))
    with pytest.raises(ProtocolError, match="malformed 'ask'"):
        ECHO.decode(msgpack.packb(["echo-test", 3, "ask", {"bogus": 1}]))
    with pytest.raises(ProtocolError, match="undecodable"):
        ECHO.decode(b"\xc1garbage")
    with pytest.raises(TypeError):
        ECHO.encode(msg)


async def test_rpc_replies_errors_and_timeouts() -> None:
    async def handle(msg: Ask) -> Answer:
        if msg.fail == "user":
            raise YutuError("bad text", ErrorKind.INVALID_REQUEST)
        if msg.fail == "bug":
            raise RuntimeError("boom")
        if msg.fail == "slow":
            await asyncio.sleep(5)
        return Answer(msg.text.upper())

    server = RpcServer(ECHO, handle)
    server.start()
    client = RpcClient(ECHO, server.endpoint, timeout_s=2)
    try:
        replies = await asyncio.gather(*(client.call(Ask(f"m{i}")) for i in range(50)))
        assert [r.text for r in replies] == [f"M{i}" for i in range(50)]
        with pytest.raises(YutuError, match="bad text") as info:
            await client.call(Ask("x", fail="user"))
        assert info.value.kind is ErrorKind.INVALID_REQUEST
        with pytest.raises(YutuError, match="RuntimeError: boom") as info:
            await client.call(Ask("x", fail="bug"))
        assert info.value.kind is ErrorKind.INTERNAL
        with pytest.raises(YutuError, match="got no answer in time") as info:
            await client.call(Ask("x", fail="slow"), timeout_s=0.2)
        assert info.value.kind is ErrorKind.UNAVAILABLE
        assert (await client.call(Ask("still alive"))).text == "STILL ALIVE"
    finally:
        await client.close()
        await server.close()


async def test_registry_register_list_expire(redis_url: str, registry_prefix: str) -> None:
    registry = Registry.from_url(redis_url, registry_prefix)
    record = ServiceRecord("worker", "w1", {"generate": "tcp://127.0.0.1:1"}, {"model": "m"})
    registration = Registration(registry, record, ttl_s=0.6)
    await registration.start()
    try:
        other = ServiceRecord("worker", "w0", {"generate": "tcp://127.0.0.1:2"})
        await registry.put(other, ttl_s=0.3)
        assert [r.instance_id for r in await registry.list("worker")] == ["w0", "w1"]
        assert await registry.list("gateway") == []
        await asyncio.sleep(0.8)  # w0 expires; w1 is kept alive by its heartbeat
        assert [r.instance_id for r in await registry.list("worker")] == ["w1"]
        registration.update_meta(load=3)
        await asyncio.sleep(0.4)
        fetched = await registry.get("worker", "w1")
        assert fetched is not None and fetched.meta == {"model": "m", "load": 3}
    finally:
        await registration.close()
    assert await registry.list("worker") == []
    await registry.close()


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def test_rpc_client_reports_its_connection() -> None:
    events: list[bool] = []
    server = RpcServer(ECHO, lambda msg: Answer(msg.text))
    server.start()
    client = RpcClient(ECHO, server.endpoint, timeout_s=5, on_connection=events.append)
    try:
        assert (await client.call(Ask("hi"))).text == "hi"
        await until(lambda: events == [True])  # the monitor's event may come after the reply
        await server.close()
        await until(lambda: events == [True, False])
        with pytest.raises(YutuError, match="got no answer in time") as info:
            await client.call(Ask("nobody there"), timeout_s=0.2)
        assert info.value.kind is ErrorKind.UNAVAILABLE
    finally:
        await client.close()
        await server.close()
