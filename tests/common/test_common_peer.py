"""The endpoints of streaming channels on real loopback sockets: yutu.rpc.Peer (ZeroMQ, the
reference) and yutu.rpc.StreamPeer (plain TCP), the same cases on both where they share a contract."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from yutu.launcher import free_port
from yutu.protocol.codec import Channel
from yutu.protocol.generate import CHANNEL as GENERATE
from yutu.protocol.generate import AbortRequest
from yutu.rpc import Peer, Sent, StreamPeer

TALK = Channel("talk-test", version=1)


@TALK.message("say")
@dataclass
class Say:
    text: str


@TALK.message("echo")
@dataclass
class Echo:
    text: str


@TALK.message("unhandled")
@dataclass
class Unhandled:
    n: int


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for ``condition`` (checked each loop turn) with a generous deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


Impl = type[Peer] | type[StreamPeer]


@pytest.fixture(params=[Peer, StreamPeer], ids=["zeromq", "stream"])
def impl(request: pytest.FixtureRequest) -> Impl:
    return request.param  # type: ignore[no-any-return]


class EchoServer:
    """A router that answers each Say with an Echo to its sender, and records who said what."""

    def __init__(self, impl: Impl, host: str = "127.0.0.1", port: int = 0) -> None:
        self.heard: list[tuple[bytes, str]] = []
        self.peer = impl.router(TALK, {Say: self.on_say}, host, port)

    def on_say(self, sender: bytes, msg: Say) -> None:
        self.heard.append((sender, msg.text))
        if msg.text == "raise":
            raise RuntimeError("handler bug")
        assert self.peer.send(Echo(msg.text.upper()), to=sender) is Sent.SENT


def collector() -> tuple[list[Any], Callable[[bytes, Any], None]]:
    got: list[Any] = []
    return got, lambda sender, msg: got.append((sender, msg))


async def test_replies_route_by_sender_identity(impl: Impl) -> None:
    server = EchoServer(impl)
    got_a, on_a = collector()
    got_b, on_b = collector()
    a = impl.dealer(TALK, {Echo: on_a}, server.peer.endpoint)
    b = impl.dealer(TALK, {Echo: on_b}, server.peer.endpoint)
    try:
        for i in range(20):
            assert a.send(Say(f"a{i}")) is Sent.SENT
            assert b.send(Say(f"b{i}")) is Sent.SENT
        await until(lambda: len(got_a) == 20 and len(got_b) == 20)
        assert [m for _, m in got_a] == [Echo(f"A{i}") for i in range(20)]
        assert [m for _, m in got_b] == [Echo(f"B{i}") for i in range(20)]
        assert {s for s, _ in got_a + got_b} == {b""}  # a DEALER's messages have no sender identity
        senders = {text[0]: sender for sender, text in server.heard}
        assert senders["a"] != senders["b"] and all(len(s) > 0 for s in senders.values())
    finally:
        a.close()
        b.close()
        server.peer.close()


async def test_unroutable_peer_is_reported_to_the_sender(impl: Impl) -> None:
    server = EchoServer(impl)
    got, on_echo = collector()
    dealer = impl.dealer(TALK, {Echo: on_echo}, server.peer.endpoint)
    try:
        assert server.peer.send(Echo("x"), to=b"nobody") is Sent.UNROUTABLE
        dealer.send(Say("hi"))
        await until(lambda: len(server.heard) == 1)
        identity = server.heard[0][0]
        await until(lambda: len(got) == 1)
        dealer.close()  # the peer goes away: its identity stops being routable
        await until(lambda: server.peer.send(Echo("late"), to=identity) is Sent.UNROUTABLE)
        assert dealer.send(Say("after close")) is Sent.CLOSED
    finally:
        dealer.close()
        server.peer.close()


async def test_bad_frames_are_dropped_and_logged_never_stopping_the_socket(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = EchoServer(Peer)
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.peer.endpoint)
    caplog.set_level(logging.WARNING, logger="yutu.rpc")
    try:
        await raw.send(b"\xc1 not msgpack")
        await raw.send(GENERATE.encode(AbortRequest("r1")))  # another channel's message
        await raw.send(msgpack.packb(["talk-test", 1, ["unhashable"], {}]))
        await raw.send_multipart([TALK.encode(Say("two parts")), b"extra"])
        await raw.send(TALK.encode(Unhandled(3)))  # a message of the channel with no handler
        await raw.send(TALK.encode(Say("raise")))  # the handler raises: logged, the next is handled
        await raw.send(TALK.encode(Say("fine")))
        reply = TALK.decode(await asyncio.wait_for(raw.recv(), 10))
        assert reply == Echo("FINE")
        assert [text for _, text in server.heard] == ["raise", "fine"]
        assert server.peer.dropped == 5
        text = caplog.text
        assert "undecodable frame" in text and "frame for channel 'generate'" in text
        assert "unknown message ['unhashable']" in text
        assert "a frame with 3 parts" in text and "an unexpected Unhandled" in text
        assert "handling a message failed" in text and "handler bug" in text
    finally:
        raw.close(linger=0)
        server.peer.close()


async def test_connection_events_and_messages_queued_before_connecting(impl: Impl) -> None:
    events: list[bool] = []
    got, on_echo = collector()
    port = free_port()
    dealer = impl.dealer(TALK, {Echo: on_echo}, f"tcp://127.0.0.1:{port}", on_connection=events.append)
    try:
        assert dealer.send(Say("early")) is Sent.SENT  # queued until the connection is up
        server = EchoServer(impl, "127.0.0.1", port)
        await until(lambda: len(got) == 1)
        assert got == [(b"", Echo("EARLY"))] and events == [True]
        server.peer.close()
        await until(lambda: events == [True, False])
    finally:
        dealer.close()


async def test_a_stream_dealer_reconnects_and_sends_what_it_queued_meanwhile() -> None:
    events: list[bool] = []
    got, on_echo = collector()
    port = free_port()
    server = EchoServer(StreamPeer, "127.0.0.1", port)
    dealer = StreamPeer.dealer(TALK, {Echo: on_echo}, server.peer.endpoint, on_connection=events.append)
    try:
        dealer.send(Say("one"))
        await until(lambda: len(got) == 1)
        server.peer.close()
        await until(lambda: events == [True, False])
        assert dealer.send(Say("two")) is Sent.SENT  # queued while disconnected
        server = EchoServer(StreamPeer, "127.0.0.1", port)  # the same address, back up
        await until(lambda: len(got) == 2)
        assert [m for _, m in got] == [Echo("ONE"), Echo("TWO")] and events == [True, False, True]
    finally:
        dealer.close()
        server.peer.close()


async def test_a_stream_router_drops_bad_frames_and_cuts_an_oversized_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = EchoServer(StreamPeer)
    host, port = server.peer.endpoint.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    caplog.set_level(logging.WARNING, logger="yutu.rpc")

    def frame(payload: bytes) -> bytes:
        return struct.pack("<I", len(payload)) + payload

    try:
        writer.write(frame(b"\xc1 not msgpack") + frame(GENERATE.encode(AbortRequest("r1"))))
        writer.write(frame(TALK.encode(Unhandled(3))) + frame(TALK.encode(Say("raise"))))
        fine = frame(TALK.encode(Say("fine")))
        writer.write(fine[:3])  # a frame split across writes is put back together
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(fine[3:])
        (length,) = struct.unpack("<I", await asyncio.wait_for(reader.readexactly(4), 10))
        assert TALK.decode(await reader.readexactly(length)) == Echo("FINE")
        assert [text for _, text in server.heard] == ["raise", "fine"] and server.peer.dropped == 3
        assert "handling a message failed" in caplog.text and "an unexpected Unhandled" in caplog.text
        writer.write(struct.pack("<I", 1 << 30))  # 1 GiB announced: the connection is cut
        assert await asyncio.wait_for(reader.read(), 10) == b""
        assert "closing a connection that sent a frame of 1073741824 bytes" in caplog.text
    finally:
        writer.close()
        server.peer.close()


@pytest.mark.parametrize("router", [True, False])
def test_handlers_must_be_messages_of_the_channel(impl: Impl, router: bool) -> None:
    with pytest.raises(TypeError, match="AbortRequest not message"):
        if router:
            impl.router(TALK, {AbortRequest: lambda sender, msg: None})
        else:
            impl.dealer(TALK, {AbortRequest: lambda sender, msg: None}, "tcp://127.0.0.1:1")
