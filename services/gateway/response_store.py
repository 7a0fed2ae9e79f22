"""Stored responses, in Redis: what ``previous_response_id``, ``GET`` / ``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read.

A response made with ``store`` (the API's default) is kept for ``--responses-ttl`` seconds under
``{prefix}:response:{id}`` as one JSON record: the response object, the input items it answered
(the earlier turns' -- inputs and outputs -- first, then its own, each with an id) and who made it.
Keeping the earlier turns in each record makes a chain of any length one read, and a turn stays
usable for as long as it is kept itself, whatever became of the ones before it.

Every gateway of a deployment shares the Redis, so a conversation may move between gateways from
one turn to the next. A record belongs to the API key that made it (its SHA-256; "" on a gateway
without keys): with another key it is not there (404), as it would be on OpenAI for another project.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from yutu.errors import ErrorKind

from services.gateway.errors import ApiError

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 3600.0


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

    async def save(self, stored: StoredResponse) -> None:
        record = {"response": stored.response, "items": stored.items, "owner": stored.owner}
        try:
            await self.redis.set(self.key(stored.response["id"]), json.dumps(record), px=self.ttl_ms)
        except (RedisError, OSError) as exc:
            raise _unavailable(exc) from None

    async def load(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response ``response_id`` of ``owner``; None when there is none (or it is another's)."""
        try:
            raw = await self.redis.get(self.key(response_id))
        except (RedisError, OSError) as exc:
            raise _unavailable(exc) from None
        if raw is None:
            return None
        record = json.loads(raw)
        if record["owner"] != owner:
            return None
        return StoredResponse(record["response"], record["items"], owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete ``owner``'s response ``response_id``; False when there is none."""
        if await self.load(response_id, owner) is None:
            return False
        try:
            return bool(await self.redis.delete(self.key(response_id)))
        except (RedisError, OSError) as exc:
            raise _unavailable(exc) from None

    async def close(self) -> None:
        await self.redis.aclose()


def _unavailable(exc: Exception) -> ApiError:
    log.warning("the response store (Redis) failed: %s", exc)
    return ApiError.of_kind(
        ErrorKind.UNAVAILABLE, f"stored responses are unavailable: Redis did not answer ({exc}); retry"
    )
