"""Clients of a streamed OpenAI completion for the benchmarks: a lean one, and httpx as the reference.

    client = LeanClient("http://127.0.0.1:8000")
    async for at, event in client.events("/v1/completions", body):  # at: time.perf_counter()
        ...
    await client.aclose()

On one 2-core machine the client that measures a server takes CPU from it. httpx spends 115-150 us
of CPU per streamed token (its connection pool, h11's parser, anyio, the byte and line decoders):
in bench_serving's 16-concurrent burst, a quarter of one of the two cores. :class:`LeanClient`
speaks just enough HTTP/1.1 on asyncio streams -- a POST with a JSON body, a status line, headers,
a chunked, sized or close-delimited body -- and splits the server-sent events itself: ~50 us a
token, most of it ``json.loads``. :class:`HttpxClient` is the same interface on httpx (the
reference; tests/loadtests/test_sse_client.py holds the two together against a real gateway).

Both yield each ``data:`` payload of the stream as a dict, with the time its bytes were read, and
stop at ``data: [DONE]`` or the body's end. A status other than 200 raises :class:`StreamError`
with the start of the body; so does a connection or a reply that fails. The caller bounds the time
of a request (bench_serving: ``asyncio.timeout`` around each). Connections are kept alive and
reused; one whose server closed it while idle (seen before any byte of the reply) is replaced, as
HTTP clients do.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx


class StreamError(RuntimeError):
    """The server answered an error status, or the exchange failed (connection, framing, time)."""


class EventClient(Protocol):
    def events(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[float, dict[str, Any]]]:
        """POST ``body`` as JSON to ``path``; yield (perf_counter when read, event) per data payload."""
        ...

    async def aclose(self) -> None: ...


def sse_payloads(buffer: bytearray) -> list[bytes]:
    """Remove every whole event (ended by a blank line) from ``buffer``; return their ``data``
    fields (an event's data lines joined by newlines; events without data are skipped)."""
    out: list[bytes] = []
    while True:
        end = buffer.find(b"\n\n")
        if end < 0:
            return out
        event = bytes(buffer[:end])
        del buffer[: end + 2]
        data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class _Reply:
    """A reply's status and body framing, read from its head."""

    def __init__(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise StreamError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
        self.status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self.length = int(length) if length is not None and not self.chunked else None
        self.keep_alive = parts[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"


class LeanClient:
    """Streamed completions over HTTP/1.1 on asyncio streams (see the module docstring)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"LeanClient speaks plain http://host[:port], got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/")
        self._idle: list[_Connection] = []

    async def events(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[float, dict[str, Any]]]:
        payload = json.dumps(body).encode()
        request = (
            f"POST {self.base}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        try:
            conn, reply = await self._send(request)
            try:
                async for item in self._read(conn, reply):
                    yield item
            except BaseException:
                conn.close()
                raise
            if reply.keep_alive:
                self._idle.append(conn)
            else:
                conn.close()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise StreamError(f"{type(exc).__name__}: {exc}") from exc

    async def _send(self, request: bytes) -> tuple[_Connection, _Reply]:
        """Send ``request`` and read the reply's head: on an idle connection if there is one (a
        fresh one if the server closed it meanwhile), else on a new one."""
        while self._idle:
            conn = self._idle.pop()
            try:
                return conn, await self._exchange(conn, request)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                conn.close()  # closed while idle: the server never read the request
                if isinstance(exc, asyncio.IncompleteReadError) and exc.partial:
                    raise
        reader, writer = await asyncio.open_connection(self.host, self.port)
        conn = _Connection(reader, writer)
        try:
            return conn, await self._exchange(conn, request)
        except BaseException:
            conn.close()
            raise

    @staticmethod
    async def _exchange(conn: _Connection, request: bytes) -> _Reply:
        conn.writer.write(request)
        await conn.writer.drain()
        head = await conn.reader.readuntil(b"\r\n\r\n")  # a head past the reader's limit (64 KiB) raises
        return _Reply(head[:-4])

    async def _read(self, conn: _Connection, reply: _Reply) -> AsyncIterator[tuple[float, dict[str, Any]]]:
        if reply.status != 200:
            body = b"".join([chunk async for chunk in _body(conn.reader, reply)])
            raise StreamError(f"the server answered {reply.status}: {body[:300]!r}")
        buffer = bytearray()
        done = False
        async for chunk in _body(conn.reader, reply):
            if done:
                continue  # read to the body's end, so the connection can carry the next request
            at = time.perf_counter()
            buffer += chunk
            if b"\r" in buffer:  # CRLF line ends (a CR at the end waits for its LF)
                buffer[:] = buffer.replace(b"\r\n", b"\n")
            for data in sse_payloads(buffer):
                if data == b"[DONE]":
                    done = True
                    break
                yield at, json.loads(data)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


async def _body(reader: asyncio.StreamReader, reply: _Reply) -> AsyncIterator[bytes]:
    """The reply's body, as it comes."""
    if reply.chunked:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                    pass
                return
            chunk = await reader.readexactly(size + 2)
            yield chunk[:-2]
    elif reply.length is not None:
        if reply.length:
            yield await reader.readexactly(reply.length)
    else:  # delimited by the connection's close
        while chunk := await reader.read(1 << 16):
            yield chunk
        reply.keep_alive = False


class HttpxClient:
    """The same interface on httpx (the reference :class:`LeanClient` is tested against)."""

    def __init__(self, url: str, timeout_s: float = 300.0, connections: int = 64) -> None:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self._http = httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits)

    async def events(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[float, dict[str, Any]]]:
        try:
            async with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    raise StreamError(
                        f"the server answered {resp.status_code}: {(await resp.aread())[:300]!r}"
                    )
                done = False
                async for line in resp.aiter_lines():  # to the end, so the connection is kept
                    if line.startswith("data:") and not done:
                        data = line[5:].removeprefix(" ")
                        done = data == "[DONE]"
                        if not done:
                            yield time.perf_counter(), json.loads(data)
        except httpx.HTTPError as exc:
            raise StreamError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self._http.aclose()
