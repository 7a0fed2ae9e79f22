"""Connecting to Redis so that a restarted Redis is not an error.

A Redis that restarts (a crash under ``yutu up``'s supervision, an operator's restart) leaves every
pooled connection of every client dead, and redis-py's default client sends the next command on
each of them once more, failing it ("Connection closed by server") although Redis is back. A
client from :func:`connect` sends such a command again on a fresh connection, twice at most, after
a short backoff.

Only for clients whose commands are all safe to send twice: Yutu's are (SET of a record, HSET of
current values, DEL, EXISTS, reads, SET NX whose loser re-reads, idempotent Lua).

Its connections pack commands with hiredis's C packer where that gives the very bytes redis-py's
Python packer does (:class:`HiredisPacking`): redis-py's asyncio connection joins a command's
arguments one by one into a growing buffer, ~97 us for the store master's write-behind HSET of 80
records against ~15 us (timeit), time the master's event loop is not answering requests.
"""

from __future__ import annotations

from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

RETRIES = 2


class HiredisPacking(AbstractConnection):
    """A connection whose commands are packed by hiredis when every argument is a ``str``, ``bytes``
    or ``int`` (not ``bool``, which redis-py refuses) no longer than redis-py's buffer cutoff (it
    sends longer values as buffers of their own, without copying them), the command name is one
    word and strings are UTF-8 (strict): then the bytes are redis-py's. Else redis-py packs it (the
    reference; tests hold the two equal)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        cutoff = self._buffer_cutoff
        encoder = self.encoder
        if encoder.encoding != "utf-8" or encoder.encoding_errors != "strict" or not args:
            return super().pack_command(*args)
        name = args[0]
        if (type(name) is str and " " in name) or (type(name) is bytes and b" " in name):
            return super().pack_command(*args)
        for arg in args:
            kind = type(arg)
            if not (kind is int or ((kind is str or kind is bytes) and len(arg) <= cutoff)):
                return super().pack_command(*args)
        return [hiredis.pack_command(args)]


class _TcpConnection(HiredisPacking, Connection):
    pass


class _UnixConnection(HiredisPacking, UnixDomainSocketConnection):
    pass


class _SslConnection(HiredisPacking, SSLConnection):
    pass


_PACKED = {
    Connection: _TcpConnection,
    UnixDomainSocketConnection: _UnixConnection,
    SSLConnection: _SslConnection,
}


def connect(url: str) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` that resends a command failed by a dead connection and
    packs commands with hiredis (see the module docstring)."""
    retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=RETRIES)
    client = aioredis.from_url(url, retry=retry, retry_on_error=[RedisConnectionError, RedisTimeoutError])
    pool = client.connection_pool
    pool.connection_class = _PACKED.get(pool.connection_class, pool.connection_class)
    return client
