"""The Redis-backed service registry.

Every instance writes one record under ``{prefix}:svc:{kind}:{instance_id}`` with a TTL and keeps it
alive with a heartbeat task; an instance that dies simply expires. Readers list a kind with SCAN.
Records are JSON so operators can read them with ``redis-cli``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from yutu.supervise import Supervisor, cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceRecord:
    """What an instance tells the world about itself."""

    kind: str  # "gateway" | "worker" | "prefill" | "decode" | "conductor" | "store-master" | "store-node"
    instance_id: str
    endpoints: dict[str, str]  # e.g. {"generate": "tcp://127.0.0.1:5555", "admin": "http://127.0.0.1:8101"}
    meta: dict[str, Any] = field(default_factory=dict)
    hostname: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    started_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ServiceRecord:
        """Parse a record; raises :class:`MalformedRecord` for anything that is not one."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MalformedRecord(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise MalformedRecord(f"a JSON {type(data).__name__}, not an object")
        try:
            record = cls(**data)
        except TypeError as exc:
            raise MalformedRecord(str(exc)) from None
        checks = (
            ("kind", str),
            ("instance_id", str),
            ("endpoints", dict),
            ("meta", dict),
            ("hostname", str),
            ("pid", int),
            ("started_at", int | float),
        )
        for name, kind in checks:
            if not isinstance(getattr(record, name), kind):
                raise MalformedRecord(f"field {name!r} is {getattr(record, name)!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in record.endpoints.items()):
            raise MalformedRecord(f"endpoints must map names to URLs, got {record.endpoints!r}")
        return record


class MalformedRecord(ValueError):
    """A registry value that is not a valid :class:`ServiceRecord` (written by a bug or by hand)."""


class Registry:
    """Register, keep alive and look up service instances in Redis."""

    def __init__(self, redis: aioredis.Redis, prefix: str = "yutu") -> None:
        self.redis = redis
        self.prefix = prefix
        self.skipped: dict[str, str] = {}  # key -> why it was skipped on the last listing (malformed)

    @classmethod
    def from_url(cls, url: str, prefix: str = "yutu") -> Registry:
        return cls(aioredis.from_url(url), prefix)

    def key(self, kind: str, instance_id: str) -> str:
        return f"{self.prefix}:svc:{kind}:{instance_id}"

    async def ping(self) -> None:
        await self.redis.ping()

    async def put(self, record: ServiceRecord, ttl_s: float) -> None:
        await self.redis.set(
            self.key(record.kind, record.instance_id), record.to_json(), px=int(ttl_s * 1000)
        )

    async def remove(self, kind: str, instance_id: str) -> None:
        await self.redis.delete(self.key(kind, instance_id))

    async def list(self, kind: str) -> list[ServiceRecord]:
        """Live instances of ``kind``, sorted by instance id.

        A malformed record (not JSON, wrong fields, filed under another kind) is skipped and
        logged once per key while it stays: one bad value never hides the good ones.
        """
        keys = [k async for k in self.redis.scan_iter(match=self.key(kind, "*"), count=200)]
        if not keys:
            self._forget_skipped(kind, set())
            return []
        values = await self.redis.mget(keys)
        records: list[ServiceRecord] = []
        bad: set[str] = set()
        for raw_key, value in zip(keys, values, strict=True):
            if value is None:
                continue  # expired between SCAN and MGET
            key = raw_key.decode(errors="replace") if isinstance(raw_key, bytes) else str(raw_key)
            try:
                record = ServiceRecord.from_json(value)
                if self.key(record.kind, record.instance_id) != key:
                    raise MalformedRecord(
                        f"its kind/instance_id ({record.kind}/{record.instance_id}) do not match"
                    )
            except MalformedRecord as exc:
                bad.add(key)
                if key not in self.skipped:
                    log.warning("registry: skipping malformed record %s: %s", key, exc)
                self.skipped[key] = str(exc)
                continue
            records.append(record)
        self._forget_skipped(kind, bad)
        return sorted(records, key=lambda r: r.instance_id)

    def _forget_skipped(self, kind: str, still_bad: set[str]) -> None:
        prefix = self.key(kind, "")
        for key in [k for k in self.skipped if k.startswith(prefix) and k not in still_bad]:
            del self.skipped[key]

    async def get(self, kind: str, instance_id: str) -> ServiceRecord | None:
        """The record of one instance; None if absent. Raises MalformedRecord for a bad value."""
        raw = await self.redis.get(self.key(kind, instance_id))
        return None if raw is None else ServiceRecord.from_json(raw)

    async def close(self) -> None:
        await self.redis.aclose()


class Registration:
    """Keeps one record alive: re-written every ``ttl_s / 3`` seconds, deleted on :meth:`close`.

    A Redis outage, or any other failure of one heartbeat, is logged and retried; the record
    reappears once Redis is back. With a ``supervisor`` (a service's ``loops``) the heartbeat task
    is watched by it, so if it dies anyway the service turns not ready and says why.
    """

    def __init__(
        self,
        registry: Registry,
        record: ServiceRecord,
        ttl_s: float = 10.0,
        supervisor: Supervisor | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"registration ttl must be positive, got {ttl_s}")
        self.registry = registry
        self.record = record
        self.ttl_s = ttl_s
        self._supervisor = supervisor
        self._task: asyncio.Task[None] | None = None

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The heartbeat task (None before :meth:`start`)."""
        return self._task

    async def start(self) -> None:
        await self.registry.put(self.record, self.ttl_s)  # fail fast if Redis is unreachable at start
        name = f"registration-{self.record.kind}"
        self._task = asyncio.create_task(self._keep_alive(), name=name)
        if self._supervisor is not None:
            self._supervisor.watch(name, self._task)

    def update_meta(self, **meta: Any) -> None:
        """Change the record's meta; written on the next heartbeat."""
        self.record = ServiceRecord(**{**asdict(self.record), "meta": {**self.record.meta, **meta}})

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self.registry.put(self.record, self.ttl_s)
            except (RedisError, OSError) as exc:
                log.warning("registry heartbeat for %s failed: %s", self.record.instance_id, exc)
            except Exception:  # noqa: BLE001 - e.g. meta that stopped being JSON: retried next beat
                log.exception("registry heartbeat for %s failed unexpectedly", self.record.instance_id)

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], f"registration of {self.record.instance_id}")
        try:
            await self.registry.remove(self.record.kind, self.record.instance_id)
        except (RedisError, OSError) as exc:
            log.warning("could not deregister %s: %s", self.record.instance_id, exc)
