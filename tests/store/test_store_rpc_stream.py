"""The store channel's stream RPC (yutu.rpc.stream) answers exactly like the ZeroMQ reference
(yutu.rpc.reqrep), fails calls on a dropped connection at once, reconnects, and is what store
clients use when the master advertises it."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import Any

import pytest
from yutu.errors import ErrorKind, YutuError
from yutu.launcher import free_port
from yutu.protocol import store as p
from yutu.rpc import RpcClient, RpcServer
from yutu.rpc.stream import HEADER, NotConnectedError, StreamRpcClient, StreamRpcServer

from tests.store.conftest import Cluster


class Handler:
    """Deterministic answers covering every path of a server: plain, awaited, typed error,
    unexpected exception, a reply the channel cannot encode, and a call held until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    def __call__(self, msg: Any) -> Any:
        if isinstance(msg, p.Exists):
            if msg.key == "missing":
                raise YutuError("object 'missing' not found", ErrorKind.NOT_FOUND)
            if msg.key == "crash":
                raise RuntimeError("handler bug")
            if msg.key == "unencodable":
                return object()
            if msg.key == "held":
                return self._held()
            return p.ExistsReply(msg.key == "here")
        if isinstance(msg, p.BatchExists):
            return self._later([k == "here" for k in msg.keys])
        raise YutuError(f"{type(msg).__name__} is not served here", ErrorKind.INVALID_REQUEST)

    async def _later(self, flags: list[bool]) -> p.BatchExistsReply:
        await asyncio.sleep(0.001 * len(flags))  # later for longer batches: answers come out of order
        return p.BatchExistsReply(flags)

    async def _held(self) -> p.ExistsReply:
        await self.release.wait()
        return p.ExistsReply(True)


async def outcome(client: RpcClient | StreamRpcClient, msg: Any) -> Any:
    try:
        return await client.call(msg, timeout_s=5.0)
    except YutuError as exc:
        return ("error", exc.kind, str(exc))


CALLS: list[Any] = [
    p.Exists("here"),
    p.Exists("elsewhere"),
    p.Exists("missing"),
    p.Exists("crash"),
    p.Exists("unencodable"),
    p.BatchExists(["here", "x", "here"]),
    p.GetStats(),
]


async def test_stream_answers_every_call_exactly_like_the_zeromq_reference() -> None:
    handler = Handler()
    zmq_server = RpcServer(p.CHANNEL, handler)
    zmq_server.start()
    stream_server = StreamRpcServer(p.CHANNEL, handler)
    await stream_server.start()
    zmq_client = RpcClient(p.CHANNEL, zmq_server.endpoint)
    stream_client = StreamRpcClient(p.CHANNEL, stream_server.endpoint)
    try:
        reference = [await outcome(zmq_client, m) for m in CALLS]
        streamed = [await outcome(stream_client, m) for m in CALLS]
        assert streamed == reference
        assert reference[0] == p.ExistsReply(True) and reference[1] == p.ExistsReply(False)
        assert reference[2] == ("error", ErrorKind.NOT_FOUND, "object 'missing' not found")
        assert reference[3] == ("error", ErrorKind.INTERNAL, "RuntimeError: handler bug")
        assert reference[4][:2] == ("error", ErrorKind.INTERNAL)
        assert reference[5] == p.BatchExistsReply([True, False, True])
        assert reference[6] == ("error", ErrorKind.INVALID_REQUEST, "GetStats is not served here")
        # many calls in flight on one connection, answered out of order, each to its caller
        batches = [p.BatchExists(["here"] * n + ["no"]) for n in range(40, 0, -1)]
        replies = await asyncio.gather(*(stream_client.call(b) for b in batches))
        assert [r.exists for r in replies] == [[True] * n + [False] for n in range(40, 0, -1)]
    finally:
        await zmq_client.close()
        await stream_client.close()
        await zmq_server.close()
        await stream_server.close()


async def test_a_client_polling_for_replies_answers_like_one_that_sleeps() -> None:
    """``spin_s`` (yutu.busypoll) changes how a caller waits, not what it gets: the same outcomes,
    other calls go out and come back while one polls, and a call's timeout still ends it."""
    handler = Handler()
    server = StreamRpcServer(p.CHANNEL, handler)
    await server.start()
    sleeping = StreamRpcClient(p.CHANNEL, server.endpoint)
    polling = StreamRpcClient(p.CHANNEL, server.endpoint, spin_s=30.0)  # polls for as long as a call lasts
    try:
        assert [await outcome(polling, m) for m in CALLS] == [await outcome(sleeping, m) for m in CALLS]
        held = asyncio.ensure_future(polling.call(p.Exists("held"), timeout_s=30.0))
        await asyncio.sleep(0.05)
        assert not held.done()
        # the held call's poll yields: this one is sent, answered and returned meanwhile
        assert await polling.call(p.Exists("here"), timeout_s=5.0) == p.ExistsReply(True)
        batches = [p.BatchExists(["here"] * n) for n in range(20, 0, -1)]
        replies = await asyncio.gather(*(polling.call(b) for b in batches))
        assert [r.exists for r in replies] == [[True] * n for n in range(20, 0, -1)]
        assert not held.done()
        handler.release.set()
        assert await held == p.ExistsReply(True)
        handler.release.clear()
        started = time.monotonic()
        with pytest.raises(YutuError) as err:
            await polling.call(p.Exists("held"), timeout_s=0.3)
        assert err.value.kind is ErrorKind.UNAVAILABLE and "got no answer in time" in str(err.value)
        assert time.monotonic() - started < 5.0  # the call's timeout, not the 30 s poll budget
        with pytest.raises(ValueError, match="spin_s"):
            StreamRpcClient(p.CHANNEL, server.endpoint, spin_s=-1.0)
    finally:
        handler.release.set()
        await sleeping.close()
        await polling.close()
        await server.close()


async def test_a_server_polls_after_replies_only_while_calls_come_back_to_back() -> None:
    """A polling server (``spin_s``) answers exactly like a sleeping one; it keeps its loop awake
    after a reply only when the call came within ``spin_s`` of the reply before it, and only for
    ``spin_s``: a server called now and then never polls."""
    handler = Handler()
    sleeping = StreamRpcServer(p.CHANNEL, handler)
    polling = StreamRpcServer(p.CHANNEL, handler, spin_s=0.3)
    await sleeping.start()
    await polling.start()
    to_sleeping = StreamRpcClient(p.CHANNEL, sleeping.endpoint)
    to_polling = StreamRpcClient(p.CHANNEL, polling.endpoint)
    try:
        assert [await outcome(to_polling, m) for m in CALLS] == [await outcome(to_sleeping, m) for m in CALLS]
        await asyncio.sleep(0.6)  # past the budget: the loop sleeps again
        assert not polling._awake
        assert await to_polling.call(p.Exists("here")) == p.ExistsReply(True)
        assert not polling._awake  # the first call after a pause: nothing says another follows
        assert await to_polling.call(p.Exists("here")) == p.ExistsReply(True)
        assert polling._awake  # back to back: it polls for the next one
        await asyncio.sleep(0.6)
        assert not polling._awake
        assert not sleeping._awake
        with pytest.raises(ValueError, match="spin_s"):
            StreamRpcServer(p.CHANNEL, handler, spin_s=-1.0)
    finally:
        await to_sleeping.close()
        await to_polling.close()
        await sleeping.close()
        await polling.close()


async def test_a_call_in_flight_fails_at_once_when_the_server_goes_and_the_next_reconnects() -> None:
    handler = Handler()
    server = StreamRpcServer(p.CHANNEL, handler)
    await server.start()
    port = int(server.endpoint.rsplit(":", 1)[1])
    ups: list[bool] = []
    client = StreamRpcClient(p.CHANNEL, server.endpoint, timeout_s=30.0, on_connection=ups.append)
    try:
        assert ups == []  # connects on the first call
        assert await client.call(p.Exists("here")) == p.ExistsReply(True)
        assert ups == [True]
        held = asyncio.ensure_future(client.call(p.Exists("held")))
        await asyncio.sleep(0.05)  # the request is at the server, its handler waiting
        assert not held.done()
        started = time.monotonic()
        await server.close()
        with pytest.raises(YutuError) as err:
            await held
        assert err.value.kind is ErrorKind.UNAVAILABLE and "connection to" in str(err.value)
        assert time.monotonic() - started < 5.0  # not the 30 s timeout
        assert ups == [True, False]
        # a call while nothing listens waits for the server to come back (as ZeroMQ reconnects)
        pending = asyncio.ensure_future(client.call(p.Exists("here"), timeout_s=20.0))
        await asyncio.sleep(0.2)
        assert not pending.done()
        server = StreamRpcServer(p.CHANNEL, handler, port=port)
        await server.start()
        assert await pending == p.ExistsReply(True)
        assert ups == [True, False, True]
        # and with no server at all, a call says so within its timeout
        await server.close()
        fresh = StreamRpcClient(p.CHANNEL, server.endpoint)
        with pytest.raises(NotConnectedError) as refused:
            await fresh.call(p.Exists("here"), timeout_s=0.5)
        assert refused.value.kind is ErrorKind.UNAVAILABLE and "is the server running?" in str(refused.value)
        await fresh.close()
    finally:
        await client.close()
        await server.close()


async def test_a_reply_whose_client_is_gone_goes_to_on_undelivered() -> None:
    """(What a prefill instance gives a KV hold back on.) Only replies that could not be sent, and
    only once each; errors are not handed over."""
    handler = Handler()
    undelivered: list[Any] = []
    handed = asyncio.Event()

    def on_undelivered(reply: Any) -> None:
        undelivered.append(reply)
        handed.set()

    server = StreamRpcServer(p.CHANNEL, handler, on_undelivered=on_undelivered)
    await server.start()
    client = StreamRpcClient(p.CHANNEL, server.endpoint, timeout_s=30.0)
    try:
        assert await client.call(p.Exists("here")) == p.ExistsReply(True)
        held = asyncio.ensure_future(client.call(p.Exists("held")))
        await asyncio.sleep(0.05)  # the request is at the server, its handler waiting
        await client.close()  # the caller goes before its answer
        with pytest.raises(YutuError):
            await held
        await asyncio.sleep(0.05)  # the server sees the connection end
        assert undelivered == []
        handler.release.set()  # the answer comes, with nobody to take it
        await asyncio.wait_for(handed.wait(), 5.0)
        await asyncio.sleep(0.05)
        assert undelivered == [p.ExistsReply(True)]
    finally:
        await server.close()


async def test_closing_the_client_while_a_call_connects_fails_the_call_typed_not_cancelled() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens on it: the call keeps retrying to connect
    client = StreamRpcClient(p.CHANNEL, endpoint, timeout_s=20.0)
    connecting = asyncio.ensure_future(client.call(p.Exists("here")))
    await asyncio.sleep(0.1)
    assert not connecting.done()
    await client.close()  # e.g. the gateway saw the conductor's record go and dropped its client
    with pytest.raises(NotConnectedError) as err:  # a YutuError the caller handles, not CancelledError
        await connecting
    assert err.value.kind is ErrorKind.UNAVAILABLE and "closed while connecting" in str(err.value)
    # the caller's own cancellation still cancels
    other = StreamRpcClient(p.CHANNEL, endpoint, timeout_s=20.0)
    call = asyncio.ensure_future(other.call(p.Exists("here")))
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await other.close()


async def test_a_garbled_stream_costs_its_own_connection_only() -> None:
    server = StreamRpcServer(p.CHANNEL, Handler())
    await server.start()
    host, port = server.endpoint[len("tcp://") :].rsplit(":", 1)
    client = StreamRpcClient(p.CHANNEL, server.endpoint)
    try:
        assert await client.call(p.Exists("here")) == p.ExistsReply(True)
        loop = asyncio.get_running_loop()
        for garbage in (
            HEADER.pack(1 << 30, 1, b"Q"),  # longer than any frame may be
            HEADER.pack(3, 1, b"K") + b"abc",  # a reply sent to a server
        ):
            raw = socket.create_connection((host, int(port)))
            raw.sendall(garbage)
            raw.settimeout(5.0)
            assert await loop.run_in_executor(None, raw.recv, 16) == b""  # closed by the server
            raw.close()
        # an undecodable request is answered as an invalid request, the connection stays
        raw = socket.create_connection((host, int(port)))
        raw.sendall(HEADER.pack(4, 7, b"Q") + b"\xc1zzz")
        raw.settimeout(5.0)
        head = await loop.run_in_executor(None, raw.recv, HEADER.size)
        length, call_id, status = HEADER.unpack(head)
        assert (call_id, status) == (7, b"E")
        raw.close()
        assert await client.call(p.Exists("elsewhere")) == p.ExistsReply(False)
    finally:
        await client.close()
        await server.close()
    assert struct.calcsize("<IQc") == HEADER.size == 13


async def test_store_clients_use_the_stream_endpoint_when_the_master_advertises_it(
    store_cluster: Cluster,
) -> None:
    store_cluster.master()
    store_cluster.node("n0")
    streamed = await store_cluster.client()
    plain = await store_cluster.client(master_stream=False)
    assert streamed.master is not None and plain.master is not None
    assert (streamed.master.endpoint or "").startswith("stream+tcp://127.0.0.1:")
    assert (plain.master.endpoint or "").startswith("tcp://127.0.0.1:")
    assert await streamed.put("via-stream", b"s" * 5000)
    assert await plain.put("via-zmq", b"z" * 7000)
    for client in (streamed, plain):
        assert await client.get_batch(["via-stream", "via-zmq", "nowhere"]) == [
            b"s" * 5000,
            b"z" * 7000,
            None,
        ]
        with pytest.raises(YutuError) as err:
            await client.get("nowhere")
        assert err.value.kind is ErrorKind.NOT_FOUND
