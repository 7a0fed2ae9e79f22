"""Connecting to Redis so that a restarted Redis is not an error.

A Redis that restarts (a crash under ``yutu up``'s supervision, an operator's restart) leaves every
pooled connection of every client dead, and redis-py's default client sends the next command on
each of them once more, failing it ("Connection closed by server") although Redis is back. A
client from :func:`connect` sends such a command again on a fresh connection, twice at most, after
a short backoff.

Only for clients whose commands are all safe to send twice: Yutu's are (SET of a record, HSET of
current values, DEL, EXISTS, reads, SET NX whose loser re-reads, idempotent Lua).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

RETRIES = 2


def connect(url: str) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` that resends a command failed by a dead connection."""
    retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=RETRIES)
    return aioredis.from_url(url, retry=retry, retry_on_error=[RedisConnectionError, RedisTimeoutError])
