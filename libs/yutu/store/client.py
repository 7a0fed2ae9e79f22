"""The store client: put and get objects of the distributed KV store.

    async with StoreClient(StoreClientConfig(redis_url)) as store:      # master found in the registry
        await store.put("ab12...", payload, replicas=2)                     # True: written
        data = await store.get("ab12...")                                   # bytes
        buf = store.register_buffer("kv", 64 << 20)                        # zero copy:
        await store.get_into("ab12...", buf, offset=0)                      #   straight into buf

Every call is batched: one RPC to the master for all keys (``BatchPutStart``/``BatchGetReplicas``),
one transfer submission for all blocks, one RPC to finish (``BatchPutEnd``); a put into space
reserved ahead skips the first RPC (``StoreClientConfig.reserve_bytes``, :mod:`yutu.store.reservations`). A put writes every
replica the master allocated and revokes the put if any write fails. A get reads each key from its
best replica (same host first) and falls back to the next replica when a transfer fails. Those
protocols live in :mod:`yutu.store.datapath`; this module is the API around them: argument checks,
staging, return values and errors.

Plain ``put``/``get`` copy through a registered staging buffer; ``put_from``/``get_into`` move
bytes between the store and the caller's registered buffers with no copy in this process.

With ``StoreClientConfig.lease_cache`` on, repeated gets of a key reuse its replica descriptors
while their read lease lasts, without asking the master (see :mod:`yutu.store.leases` for what
that means for removes and upserts by other clients).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from yutu.busypoll import SPIN_US
from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.redis_conn import connect
from yutu.registry import Registry
from yutu.store.datapath import DataPath
from yutu.store.leases import LeaseCache
from yutu.store.master import MasterClient
from yutu.store.mount import MountedSegment
from yutu.store.staging import Space, Staging
from yutu.store.types import PutOptions, ReplicaDescriptor, validate_key
from yutu.transfer import Region, SegmentDirectory, TransferEngine
from yutu.transfer.segment import local_host_id
from yutu.transfer.tcp_wire import DEFAULT_CONGESTION

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview | Any  # anything exporting a contiguous buffer (numpy arrays too)
SEGMENT_REGION = "segment"
STAGING_REGION = "store-staging"  # plain put/get copy through it (shared engines hold other regions too)


@dataclass(frozen=True)
class StoreClientConfig:
    redis_url: str
    prefix: str = "yutu"  # registry prefix of the deployment
    master: str | None = None  # master RPC endpoint; None: find it in the registry
    client_id: str | None = None  # also this client's transfer segment name; default: unique per process
    staging_bytes: int = 64 << 20  # buffer plain put/get copy through
    segment_bytes: int = 0  # > 0: contribute this much of the client's memory to the pool
    transports: tuple[str, ...] = ("shm", "tcp")  # ("tcp",) forces TCP even on one host
    host: str = "127.0.0.1"  # where this client's data server listens (used when it contributes memory)
    tcp_connections: int = 4
    rpc_timeout_s: float = 10.0
    master_stream: bool = True  # talk to the master over its stream RPC when advertised (yutu.store.master)
    transfer_timeout_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    lease_cache: bool = False  # reuse replica descriptors while their read lease lasts (module doc)
    lease_cache_margin_s: float = 1.0  # stop using a cached entry this long before its lease ends
    # single-replica puts of up to this many bytes per call write into space reserved ahead and
    # cost one master RPC instead of two; the client holds at most this much (yutu.store.reservations).
    # 0: every put is put_start / write / put_end
    reserve_bytes: int = 32 << 20
    # after a request to the master or a small TCP transfer (one the event loop runs), wait for the
    # answer awake for up to this long before sleeping (yutu.busypoll); 0: sleep at once. The TCP
    # part applies to the client's own transfer engine; a shared one has its own setting.
    spin_us: int = SPIN_US
    # TCP congestion control of the client's own transfer engine's data connections (None: the
    # host's default; yutu.transfer.tcp_wire.DEFAULT_CONGESTION says why Reno)
    tcp_congestion: str | None = DEFAULT_CONGESTION


class StoreClient:
    """See the module docstring.

    ``engine``: a started transfer engine to move bytes with, owned by the caller (a worker whose KV
    cache lives in one of its regions, so ``put_from``/``get_into`` reach the cache directly). The
    client registers its staging region in it and leaves it running on :meth:`close`. Without one,
    the client runs an engine of its own whose segment is named ``client_id``.
    """

    def __init__(self, config: StoreClientConfig, engine: TransferEngine | None = None) -> None:
        self.config = config
        self.client_id = (
            config.client_id or f"store-client-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        )
        if engine is not None and config.segment_bytes > 0:
            raise ValueError("a store client on a shared transfer engine cannot contribute a segment")
        self.host_id = local_host_id()
        self._redis: aioredis.Redis | None = None
        self.engine: TransferEngine | None = engine
        self._owns_engine = engine is None
        self.master: MasterClient | None = None
        self._staging: Staging | None = None
        self._segment: MountedSegment | None = None
        self._tmp_names = itertools.count()
        self._leases = LeaseCache(config.lease_cache_margin_s)  # used only with config.lease_cache
        self._datapath: DataPath | None = None

    async def start(self) -> None:
        """Connect and register; if that fails, what was taken (shared memory too) is released."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        c = self.config
        self._redis = connect(c.redis_url)  # survives a Redis restart (yutu.redis_conn)
        if self.engine is None:
            engine = TransferEngine(
                self.client_id,
                SegmentDirectory(self._redis, c.prefix),
                c.host,
                0,
                c.tcp_connections,
                c.transfer_timeout_s,
                transports=c.transports,
                tcp_spin_us=c.spin_us,
                tcp_congestion=c.tcp_congestion,
            )
            self.engine = engine
            self._staging = Staging(engine.register_region(STAGING_REGION, c.staging_bytes))
            if c.segment_bytes > 0:
                engine.register_region(SEGMENT_REGION, c.segment_bytes)
            await engine.start()
        else:
            engine = self.engine
            self._staging = Staging(engine.register_region(STAGING_REGION, c.staging_bytes))
            await engine.publish()
        self.master = MasterClient(
            c.master,
            None if c.master else Registry(self._redis, c.prefix),
            c.rpc_timeout_s,
            c.master_stream,
            spin_s=c.spin_us / 1e6,
        )
        await self.master.connect()
        self._datapath = DataPath(
            self.master, engine, self._leases, client_id=self.client_id, host_id=self.host_id,
            lease_cache=c.lease_cache, reserve_bytes=c.reserve_bytes,
        )  # fmt: skip
        if c.segment_bytes > 0:
            incarnation = engine.descriptor().incarnation
            self._segment = MountedSegment(
                self.master, self.client_id, self.client_id, SEGMENT_REGION, c.segment_bytes, incarnation,
                interval_s=c.heartbeat_interval_s,
            )  # fmt: skip
            await self._segment.mount()
            self._segment.start()

    async def close(self) -> None:
        try:
            if self._segment is not None:
                await self._segment.close()
            if self._datapath is not None:
                await self._datapath.close()
            if self.master is not None:
                await self.master.close()
        finally:
            await self._close_engine()

    async def _close_engine(self) -> None:
        if self.engine is not None:
            if self._owns_engine:
                await self.engine.close()
            elif STAGING_REGION in self.engine.regions:
                self.engine.unregister_region(STAGING_REGION)
        if self._redis is not None:
            await self._redis.aclose()

    async def __aenter__(self) -> StoreClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def register_buffer(self, name: str, size: int) -> Region:
        """A registered buffer for ``put_from``/``get_into`` (shared memory; numpy/torch views)."""
        assert self.engine is not None, "call start() first"
        return self.engine.register_region(name, size)

    @property
    def _io(self) -> DataPath:
        if self._datapath is None:
            raise RuntimeError(
                "the store client is not started: use `async with StoreClient(...)` or start()"
            )
        return self._datapath

    # -- puts ------------------------------------------------------------------------------------

    async def put(
        self, key: str, data: Buffer, *, replicas: int = 1, soft_pin: bool = False, upsert: bool = False
    ) -> bool:
        """Store ``data`` under ``key``; False if the key was already stored (and not ``upsert``)."""
        return _single(
            await self.put_batch([(key, data)], replicas=replicas, soft_pin=soft_pin, upsert=upsert)
        )

    async def put_batch(
        self,
        items: Sequence[tuple[str, Buffer]] | Mapping[str, Buffer],
        *,
        replicas: int = 1,
        soft_pin: bool = False,
        upsert: bool = False,
    ) -> list[bool]:
        """Store many objects with one RPC round per step; raises if any key failed (after the rest)."""
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        views = [_bytes_view(data) for _, data in pairs]
        keys = [_key(k) for k, _ in pairs]
        opts = PutOptions(replicas, soft_pin, upsert)
        results: list[bool | YutuError] = [False] * len(keys)
        for chunk in self._staging_chunks([len(v) for v in views]):
            sizes = [len(views[i]) for i in chunk]
            async with self._space(sizes) as (region, offsets):
                for i, offset in zip(chunk, offsets, strict=True):
                    region.buffer[offset : offset + len(views[i])] = views[i]
                sources = [(region.name, o, s) for o, s in zip(offsets, sizes, strict=True)]
                for i, r in zip(
                    chunk, await self._io.put([keys[i] for i in chunk], sources, opts), strict=True
                ):
                    results[i] = r
        return _raise_any(keys, results)

    async def put_from(
        self, key: str, buffer: Region | str, offset: int, length: int, *, replicas: int = 1,
        soft_pin: bool = False, upsert: bool = False,
    ) -> bool:  # fmt: skip
        """Store ``buffer[offset : offset + length]`` (a registered buffer) without copying it here."""
        return _single(await self.put_from_batch([key], buffer, [offset], [length], replicas=replicas,
                                                 soft_pin=soft_pin, upsert=upsert))  # fmt: skip

    async def put_from_batch(
        self, keys: Sequence[str], buffer: Region | str, offsets: Sequence[int], lengths: Sequence[int], *,
        replicas: int = 1, soft_pin: bool = False, upsert: bool = False,
    ) -> list[bool]:  # fmt: skip
        """Store each ``buffer[offset : offset + length]``; raises if any key failed (after the rest)."""
        results = await self.put_from_batch_outcomes(
            keys, buffer, offsets, lengths, replicas=replicas, soft_pin=soft_pin, upsert=upsert
        )
        return _raise_any([_key(k) for k in keys], results)

    async def put_from_batch_outcomes(
        self, keys: Sequence[str], buffer: Region | str, offsets: Sequence[int], lengths: Sequence[int], *,
        replicas: int = 1, soft_pin: bool = False, upsert: bool = False,
    ) -> list[bool | YutuError]:  # fmt: skip
        """Like :meth:`put_from_batch`, but one outcome per key instead of raising: True written,
        False already stored, or the error of that key. Bad arguments still raise."""
        if not len(keys) == len(offsets) == len(lengths):
            raise ValueError("keys, offsets and lengths must have the same length")
        name = self._region_name(buffer)
        size = self.engine.regions[name].size if self.engine is not None else 0
        for offset, length in zip(offsets, lengths, strict=True):
            if length <= 0 or offset < 0 or offset + length > size:
                raise YutuError(
                    f"[{offset}, {offset + length}) is not a non-empty range of buffer {name!r} ({size} bytes)",
                    ErrorKind.INVALID_REQUEST,
                )
        checked = [_key(k) for k in keys]
        sources = [(name, o, n) for o, n in zip(offsets, lengths, strict=True)]
        return await self._io.put(checked, sources, PutOptions(replicas, soft_pin, upsert))

    # -- gets ------------------------------------------------------------------------------------

    async def get(self, key: str) -> bytes:
        """The bytes of ``key``; raises NOT_FOUND if the store does not hold it."""
        value = (await self._get_batch([_key(key)]))[0]
        if isinstance(value, YutuError):
            raise value
        return value

    async def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """The bytes of every key, None where the store does not hold it."""
        checked = [_key(k) for k in keys]
        values = await self._get_batch(checked)
        out: list[bytes | None] = []
        for key, value in zip(checked, values, strict=True):
            if isinstance(value, YutuError):
                if value.kind is not ErrorKind.NOT_FOUND:
                    raise YutuError(f"get of {key!r} failed: {value}", value.kind)
                out.append(None)
            else:
                out.append(value)
        return out

    async def _get_batch(self, keys: list[str]) -> list[bytes | YutuError]:
        located = await self._io.locate(keys)
        values: list[bytes | YutuError] = [v if isinstance(v, YutuError) else b"" for v in located]
        found = [i for i, v in enumerate(located) if not isinstance(v, YutuError)]
        sizes = [located[i][0] for i in found]  # type: ignore[index]
        for chunk in self._staging_chunks(sizes):
            idx = [found[j] for j in chunk]
            async with self._space([sizes[j] for j in chunk]) as (region, offsets):
                dests = [(region.name, o) for o in offsets]
                errors = await self._io.read(keys, located, idx, dests)
                for i, (_, offset), error in zip(idx, dests, errors, strict=True):
                    size = located[i][0]  # type: ignore[index]
                    values[i] = error if error is not None else bytes(region.buffer[offset : offset + size])
        return values

    async def get_into(self, key: str, buffer: Region | str, offset: int = 0) -> int:
        """Copy ``key`` into a registered buffer at ``offset``; returns its size."""
        result = (await self.get_into_batch([key], buffer, [offset]))[0]
        if result is None:
            raise YutuError(f"object {key!r} not found in the store", ErrorKind.NOT_FOUND)
        return result

    async def get_into_batch(
        self, keys: Sequence[str], buffer: Region | str, offsets: Sequence[int]
    ) -> list[int | None]:
        """Copy every key into the buffer at its offset; sizes, None where the key is missing."""
        if len(keys) != len(offsets):
            raise ValueError("keys and offsets must have the same length")
        checked = [_key(k) for k in keys]
        name = self._region_name(buffer)
        region = self.engine.regions[name] if self.engine is not None else None
        assert region is not None
        located = await self._io.locate(checked)
        found = [i for i, v in enumerate(located) if not isinstance(v, YutuError)]
        for i in found:
            size = located[i][0]  # type: ignore[index]
            if offsets[i] < 0 or offsets[i] + size > region.size:
                raise YutuError(
                    f"{checked[i]!r} has {size} bytes: it does not fit buffer {name!r} ({region.size} bytes) at "
                    f"offset {offsets[i]}",
                    ErrorKind.INVALID_REQUEST,
                )
        errors = await self._io.read(checked, located, found, [(name, offsets[i]) for i in found])
        out: list[int | None] = [None] * len(checked)
        for i, error in zip(found, errors, strict=True):
            if error is not None:
                raise YutuError(f"get of {checked[i]!r} failed: {error}", error.kind)
            out[i] = located[i][0]  # type: ignore[index]
        for i, value in enumerate(located):
            if isinstance(value, YutuError) and value.kind is not ErrorKind.NOT_FOUND:
                raise YutuError(f"get of {checked[i]!r} failed: {value}", value.kind)
        return out

    # -- metadata --------------------------------------------------------------------------------

    async def exists(self, key: str) -> bool:
        assert self.master is not None
        return bool((await self.master.call(p.Exists(_key(key)))).exists)

    async def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        assert self.master is not None
        return list((await self.master.call(p.BatchExists([_key(k) for k in keys]))).exists)

    async def remove(self, key: str) -> bool:
        """Remove ``key``; False if the store did not hold it."""
        assert self.master is not None
        checked = _key(key)
        self._leases.forget([checked])
        return bool((await self.master.call(p.Remove(checked))).count)

    async def remove_batch(self, keys: Sequence[str]) -> list[bool]:
        assert self.master is not None
        checked = [_key(k) for k in keys]
        self._leases.forget(checked)
        reply = await self.master.call(p.BatchRemove(checked))
        return [bool(p.unwrap(o)) for o in reply.results]

    async def remove_all(self) -> int:
        """Remove every object of the store (publishes AllBlocksCleared); returns how many."""
        assert self.master is not None
        self._leases.clear()
        return int((await self.master.call(p.RemoveAll())).count)

    async def replicas(self, key: str) -> list[ReplicaDescriptor]:
        """Where ``key`` lives now (takes a read lease, like a get)."""
        located = (await self._io.locate([_key(key)], cached=False))[0]
        if isinstance(located, YutuError):
            raise located
        return located[1]

    async def stats(self) -> dict[str, Any]:
        assert self.master is not None
        return dict((await self.master.call(p.GetStats())).stats)

    # -- buffers ---------------------------------------------------------------------------------

    def _region_name(self, buffer: Region | str) -> str:
        assert self.engine is not None
        name = buffer.name if isinstance(buffer, Region) else buffer
        if name not in self.engine.regions:
            raise ValueError(f"buffer {name!r} is not registered: create it with register_buffer()")
        return name

    def _staging_chunks(self, sizes: list[int]) -> list[list[int]]:
        assert self._staging is not None
        return self._staging.chunks(sizes)

    def _space(self, sizes: list[int]) -> Space:
        assert self._staging is not None and self.engine is not None
        return Space(self._staging, self.engine, sizes, f"tmp-{next(self._tmp_names)}")


def _key(key: Any) -> str:
    try:
        return validate_key(key)
    except ValueError as exc:
        raise YutuError(str(exc), ErrorKind.INVALID_REQUEST) from None


def _bytes_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("put needs a contiguous buffer; copy it first (e.g. numpy.ascontiguousarray)")
    view = view.cast("B")
    if len(view) == 0:
        raise YutuError("cannot store an empty object: objects are 1 byte or more", ErrorKind.INVALID_REQUEST)
    return view


def _single(results: list[bool]) -> bool:
    return results[0]


def _raise_any(keys: list[str], results: Sequence[bool | YutuError]) -> list[bool]:
    errors = [(k, r) for k, r in zip(keys, results, strict=True) if isinstance(r, YutuError)]
    if errors:
        key, first = errors[0]
        more = f" (and {len(errors) - 1} more keys)" if len(errors) > 1 else ""
        raise YutuError(f"put of {key!r} failed: {first}{more}", first.kind)
    return [bool(r) for r in results]
