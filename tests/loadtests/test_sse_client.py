"""loadtests/sse_client.py: the lean streaming client against httpx (the reference).

On a local server that replies as servers may (chunked with CRLF line ends split across chunks,
sized, close-delimited, closing an idle connection, an error status), both clients must yield the
same events and raise alike; on a real gateway (``yutu up --workers 1 --store-nodes 0``, the demo
model) both must stream the same tokens of the same greedy completion.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "loadtests"))

from disagg_stack import Stack, StackSpec, private_dir, shm_directory  # noqa: E402
from sse_client import EventClient, HttpxClient, LeanClient, StreamError, sse_payloads  # noqa: E402

TIMEOUT_S = 60.0  # a client that hangs fails the test instead
EVENTS = [{"n": i, "text": "é" * i} for i in range(5)]
STREAM = (
    "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in EVENTS)
    + ": a comment\r\n\r\ndata: [DONE]\r\n\r\n"
)


def chunked(body: bytes, cuts: list[int]) -> bytes:
    """``body`` in chunked transfer coding, a chunk ending at each of ``cuts`` (ascending)."""
    ends = [*cuts, len(body)]
    parts = [body[a:b] for a, b in zip([0, *cuts], ends, strict=True)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


Reply = Callable[[int], bytes]  # the reply to the n-th request on a connection (0-based)


class Server:
    """A local HTTP server answering every request on a connection with ``reply(n)``; closes the
    connection after the reply when ``close_after`` says so. Counts connections."""

    def __init__(self, reply: Reply, close_after: Callable[[int], bool] = lambda n: False) -> None:
        self.reply, self.close_after = reply, close_after
        self.connections = 0
        self.bodies: list[Any] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                self.bodies.append(json.loads(await reader.readexactly(length)))
                writer.write(self.reply(n))
                await writer.drain()
                if self.close_after(n):
                    break
                n += 1
        except asyncio.IncompleteReadError:
            pass  # the client closed it
        finally:
            writer.close()


def sse_chunked(n: int) -> bytes:
    body = STREAM.encode()
    # chunks that end inside an event, between "\r" and "\n", and inside a two-byte character
    cuts = [7, body.index(b"\r\n") + 1, body.index("é".encode()) + 1, body.index("é".encode()) + 4]
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + chunked(body, cuts)


def sse_sized(n: int) -> bytes:
    body = STREAM.encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


def sse_until_close(n: int) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + STREAM.encode()
    )


def refused(n: int) -> bytes:
    body = b'{"error": {"message": "no such model", "type": "invalid_request_error"}}'
    return b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


async def collect(client: EventClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        return [event async for _, event in client.events("/v1/completions", body)]
    finally:
        await client.aclose()


def in_turn(client: EventClient, body: dict[str, Any], requests: int) -> list[list[dict[str, Any]]]:
    """The events of ``requests`` requests sent one after another through ``client``."""

    async def run() -> list[list[dict[str, Any]]]:
        try:
            return [[e async for _, e in client.events("/v1/completions", body)] for _ in range(requests)]
        finally:
            await client.aclose()

    return asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))


def served(reply: Reply, test: Callable[[str, Server], Awaitable[None]], **kw: Any) -> Server:
    server = Server(reply, **kw)

    async def main() -> None:
        async with server as url:
            await asyncio.wait_for(test(url, server), TIMEOUT_S)

    asyncio.run(main())
    return server


@pytest.mark.parametrize(
    "reply", [sse_chunked, sse_sized, sse_until_close], ids=["chunked", "sized", "close"]
)
def test_both_clients_yield_every_event_of_each_body_framing(reply: Reply) -> None:
    got: dict[str, list[Any]] = {}

    async def test(url: str, server: Server) -> None:
        for name, client in (("lean", LeanClient(url)), ("httpx", HttpxClient(url))):
            got[name] = [[e async for _, e in client.events("/v1/completions", {"i": i})] for i in range(3)]
            await client.aclose()

    server = served(reply, test, close_after=lambda n: reply is sse_until_close)
    assert got["lean"] == got["httpx"] == [EVENTS] * 3
    assert server.bodies == [{"i": i} for i in range(3)] * 2  # the JSON body arrived as sent
    # kept alive: one connection per client; closed after each reply: one per request
    assert server.connections == (6 if reply is sse_until_close else 2)


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    got: list[Any] = []

    async def test(url: str, server: Server) -> None:
        client = LeanClient(url)
        for _ in range(3):
            got.append([e async for _, e in client.events("/v1/completions", {})])
            await asyncio.sleep(0.05)  # the server's close reaches the idle connection
        await client.aclose()

    server = served(sse_sized, test, close_after=lambda n: True)  # keep-alive promised, then closed
    assert got == [EVENTS] * 3
    assert server.connections == 3


def test_an_error_status_raises_with_its_body_on_both() -> None:
    errors: dict[str, str] = {}

    async def test(url: str, server: Server) -> None:
        for name, client in (("lean", LeanClient(url)), ("httpx", HttpxClient(url))):
            with pytest.raises(StreamError) as info:
                await collect(client, {})
            errors[name] = str(info.value)

    served(refused, test)
    for message in errors.values():
        assert "404" in message and "no such model" in message


def test_a_refused_connection_raises_a_stream_error() -> None:
    async def test() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()  # nothing listens there now
        with pytest.raises(StreamError):
            await collect(LeanClient(f"http://127.0.0.1:{port}"), {})

    asyncio.run(asyncio.wait_for(test(), TIMEOUT_S))


def test_sse_payloads_takes_whole_events_and_leaves_the_rest() -> None:
    buf = bytearray(b"data: a\n\nevent: x\ndata: b\ndata: c\n\n: only a comment\n\ndata: d")
    assert sse_payloads(buf) == [b"a", b"b\nc"]
    assert buf == bytearray(b"data: d")


def test_both_clients_stream_the_same_completion_from_a_real_gateway(tmp_path: Path) -> None:
    spec = StackSpec("sse", workers=1, store_nodes=0, max_model_len=512, kv_cache_memory_mib=32)
    with (
        private_dir(tmp_path, "yutu-sse-") as work,
        shm_directory() as shm,
        Stack(spec, work / "s", shm) as stack,
    ):
        body = {"model": stack.model, "prompt": list(range(1, 40)), "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        lean = in_turn(LeanClient(stack.url), body, 2)
        reference = in_turn(HttpxClient(stack.url), body, 2)
        bad = {**body, "model": "no-such-model"}

        async def refused_by(client: EventClient) -> str:
            with pytest.raises(StreamError) as info:
                await collect(client, bad)
            return str(info.value)

        errors = [
            asyncio.run(refused_by(LeanClient(stack.url))),
            asyncio.run(refused_by(HttpxClient(stack.url))),
        ]

    def tokens(events: list[dict[str, Any]]) -> list[str]:
        return [
            t for e in events for c in e["choices"] for t in (c.get("logprobs") or {}).get("tokens") or ()
        ]

    def finish(events: list[dict[str, Any]]) -> list[str]:
        return [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]

    for run in lean + reference:
        assert len(tokens(run)) == 12 and finish(run) == ["length"]
    assert [tokens(r) for r in lean] == [tokens(r) for r in reference]  # greedy: the same tokens
    assert all(t.startswith("token_id:") for t in tokens(lean[0]))
    for message in errors:
        assert "404" in message and "no-such-model" in message
