"""Stored responses, in Redis: what ``previous_response_id``, ``GET`` / ``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read.

A response made with ``store`` (the API's default) is kept for ``--responses-ttl`` seconds under
``{prefix}:response:{id}`` as one JSON record: the response object, the input items it answered
(the earlier turns' -- inputs and outputs -- first, then its own, each with an id) and who made it.
Keeping the earlier turns in each record makes a chain of any length one read, and a turn stays
usable for as long as it is kept itself, whatever became of the ones before it.

A background response's record is written when it is queued and rewritten as it runs; while it
runs it names the gateway running it (``runner``), and ``{key}:cancel`` is the flag a cancel on
any gateway raises for it (services/gateway/background.py); its events, as a stream of it sends them,
are kept under ``{key}:events`` (a Redis stream, the entry of event N with id ``0-{N+1}``) for the
clients that stream it, from its start or from where they were. Records change with optimistic
transactions (``WATCH``), so a cancel and the runner's last write never undo one another.

Every gateway of a deployment shares the Redis, so a conversation may move between gateways from
one turn to the next. A record belongs to the API key that made it (its SHA-256; "" on a gateway
without keys): with another key it is not there (404), as it would be on OpenAI for another project.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError
from yutu.errors import ErrorKind

from services.gateway.errors import ApiError

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 3600.0
RUNNING = frozenset({"queued", "in_progress"})  # a background response's statuses until it ends


def owner_of(authorization: str | None) -> str:
    """Whom a request's stored responses belong to on a gateway with API keys: the SHA-256 of its
    bearer token ("" without one)."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return ""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    items: list[dict[str, Any]]  # the input items it answered, earlier turns' first, each with an id
    owner: str
    runner: str | None = None  # the instance id of the gateway running it (a background response)

    @property
    def running(self) -> bool:
        return self.response["status"] in RUNNING

    def context(self) -> list[dict[str, Any]]:
        """The input items of the turn after it: its items and its output. A reasoning item the
        output ends with (the answer was cut off while the model thought) has no assistant turn to
        go with, and is left out."""
        output = list(self.response["output"])
        if output and output[-1].get("type") == "reasoning":
            output.pop()
        return [*self.items, *output]


class ResponseStore:
    """Stored responses in Redis (module docstring); a Redis that cannot be reached is a 503."""

    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: float) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_ms = max(1, round(ttl_s * 1000))

    def key(self, response_id: str) -> str:
        return f"{self.prefix}:response:{response_id}"

    def _events_key(self, response_id: str) -> str:
        return self.key(response_id) + ":events"

    def _cancel_key(self, response_id: str) -> str:
        return self.key(response_id) + ":cancel"

    async def save(self, stored: StoredResponse) -> None:
        with _reachable():
            await self.redis.set(self.key(stored.response["id"]), _record(stored), px=self.ttl_ms)

    async def change(
        self, response_id: str, owner: str, update: Callable[[StoredResponse], StoredResponse | None]
    ) -> StoredResponse | None:
        """``update`` applied to ``owner``'s response ``response_id`` as one transaction: it gets the
        record as it is and returns the new one (kept for the TTL from now), or None to leave it.
        Returns the record as it is after; None when there is none."""
        key = self.key(response_id)
        with _reachable():
            async with self.redis.pipeline() as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        current = _decoded(await pipe.get(key), owner)
                        new = None if current is None else update(current)
                        if new is None:
                            await pipe.unwatch()
                            return current
                        pipe.multi()
                        pipe.set(key, _record(new), px=self.ttl_ms)
                        await pipe.execute()
                        return new
                    except WatchError:  # written meanwhile: look again
                        continue

    async def request_cancel(self, response_id: str) -> None:
        """Raise the flag the gateway running ``response_id`` looks for."""
        with _reachable():
            await self.redis.set(self._cancel_key(response_id), b"1", px=self.ttl_ms)

    async def cancel_requested(self, response_id: str) -> bool:
        with _reachable():
            return bool(await self.redis.exists(self._cancel_key(response_id)))

    async def append_events(self, response_id: str, events: list[tuple[int, str]]) -> None:
        """Keep a background response's events (sequence number, the event as sent), in order."""
        key = self._events_key(response_id)
        pipe = self.redis.pipeline(transaction=False)
        for sequence, text in events:
            pipe.xadd(key, {"e": text}, id=f"0-{sequence + 1}")
        pipe.pexpire(key, self.ttl_ms)
        with _reachable():
            await pipe.execute()

    async def read_events(self, response_id: str, after: int, block_ms: int | None) -> list[tuple[int, str]]:
        """A background response's events after sequence number ``after``, waiting up to
        ``block_ms`` for one when there is none yet (None: not waiting)."""
        with _reachable():
            got: Any = await self.redis.xread(  # [(key, entries)]
                {self._events_key(response_id): f"0-{after + 1}"}, block=block_ms
            )
        return [
            (int(entry_id.decode().partition("-")[2]) - 1, fields[b"e"].decode())
            for _, entries in got
            for entry_id, fields in entries
        ]

    async def load(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response ``response_id`` of ``owner``; None when there is none (or it is another's)."""
        with _reachable():
            raw = await self.redis.get(self.key(response_id))
        return _decoded(raw, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete ``owner``'s response ``response_id``; False when there is none."""
        if await self.load(response_id, owner) is None:
            return False
        with _reachable():
            return bool(await self.redis.delete(self.key(response_id), self._events_key(response_id)))

    async def close(self) -> None:
        await self.redis.aclose()


def _record(stored: StoredResponse) -> str:
    return json.dumps(
        {"response": stored.response, "items": stored.items, "owner": stored.owner, "runner": stored.runner}
    )


def _decoded(raw: bytes | str | None, owner: str) -> StoredResponse | None:
    """A record's response if it is ``owner``'s."""
    if raw is None:
        return None
    record = json.loads(raw)
    if record["owner"] != owner:
        return None
    return StoredResponse(record["response"], record["items"], owner, record.get("runner"))


@contextmanager
def _reachable() -> Iterator[None]:
    """Redis calls whose failure is the 503 the routes answer (logged)."""
    try:
        yield
    except (RedisError, OSError) as exc:
        log.warning("the response store (Redis) failed: %s", exc)
        raise ApiError.of_kind(
            ErrorKind.UNAVAILABLE, f"stored responses are unavailable: Redis did not answer ({exc}); retry"
        ) from None
