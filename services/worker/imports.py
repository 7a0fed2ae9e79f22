"""KV imports: copy into this worker's cache the KV an admitted request does not compute itself.

The engine admits a request that imports KV into ``loading`` and hands its :class:`KVLoad` (the
blocks to fill) to the event loop; this module copies the KV in and answers ``finish_load`` with
how many tokens arrived, whatever happened (a failed copy means those tokens are computed)::

    decode:   FromPeer(handle)  -> one batched READ from the prefill's KV region -> release its hold
              (the prefill instance writes those blocks into the store: not written again here)
              Awaiting          -> told before the prefill ended: the load waits here, admitted,
                                   until ``ready`` brings the handle and the first token; the READ
                                   starts then, with no round trip through the engine first
    prefill:  FromStore(keys)   -> one batched get_into from the KV store (the planned prefix)
    (a decode prefilling locally, or taking over a migrated request, imports FromStore too)

Nothing here blocks the event loop, and nothing rides a control message: bytes move through the
transfer engine only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from yutu.engine.engine import KVLoad
from yutu.protocol.prefill import KVHandle
from yutu.store.client import StoreClient
from yutu.transfer import TransferEngine
from yutu.worker.kv_io import fetch_from_store, pull_blocks
from yutu.worker.kv_region import KVRegion
from yutu.worker.write_behind import WriteBehind

from services.worker.engine_loop import EngineFront

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FromPeer:
    """Pull the blocks a prefill instance holds for this request. ``keys[i]``: the key of block ``i``
    (full blocks; may be empty without write-behind): the prefill instance that computed them
    writes them into the store, so the pulled ones are not written again from here."""

    handle: KVHandle
    keys: list[str] = field(default_factory=list)
    token: int | None = None  # the first token, for a request admitted awaiting it (Awaiting)


@dataclass
class Awaiting:
    """The prompt's KV comes from a prefill instance still computing it; ``keys``: as FromPeer's."""

    num_tokens: int  # the prompt's tokens, whose KV the prefill instance will hold
    keys: list[str] = field(default_factory=list)
    load: KVLoad | None = None  # the engine admitted the request: these blocks wait for the KV


@dataclass(frozen=True)
class FromStore:
    """Fetch the request's leading blocks from the KV store; ``keys[i]`` is the key of block ``i``."""

    keys: list[str]


Source = FromPeer | FromStore | Awaiting
TRANSFERS_KEPT = 512
DROPPED_KEPT = 4096  # ids of requests dropped before their import started (their loads may still come)


class KVImports:
    def __init__(
        self,
        engine_loop: EngineFront,
        transfer: TransferEngine,
        region: KVRegion,
        store: StoreClient | None,
        write_behind: WriteBehind | None,
        block_size: int,
        release_remote: Callable[[KVHandle], None],  # ReleaseKV of the handle's hold
        timeout_s: float = 10.0,
        *,
        kv_salt: str,
    ) -> None:
        """``kv_salt``: what our engine salts block keys with (model and dtype), which a prefill's
        handle must match to be pulled."""
        self.engine_loop = engine_loop
        self.transfer = transfer
        self.region = region
        self.store = store
        self.write_behind = write_behind
        self.block_size = block_size
        self._release_remote = release_remote
        self.timeout_s = timeout_s
        self.kv_salt = kv_salt
        self._sources: dict[str, Source] = {}
        self._dropped: dict[str, None] = {}  # oldest first, at most DROPPED_KEPT
        self._tasks: set[asyncio.Task[None]] = set()
        self.transfers: list[list[float]] = []  # [bytes, seconds] since the last load report
        self.pulled_blocks = 0
        self.fetched_blocks = 0
        self.failed = 0  # imports that brought less than planned
        self.awaited = 0  # requests admitted while their prompt was prefilled elsewhere (Awaiting)
        self.awaits_dropped = 0  # of those, ended before their KV came (prefill failed, aborted)
        self.mismatched = 0  # handles refused: the prefill's KV blocks are not laid out as ours
        self.transfer_bytes = (
            0  # KV bytes imported, since start (pulled from peers or fetched from the store)
        )
        self.transfer_seconds = 0.0  # time those imports took

    def expect(self, request_id: str, source: Source) -> None:
        """Say where ``request_id``'s KV comes from; its KVLoad arrives once the engine admits it."""
        self._sources[request_id] = source
        if isinstance(source, Awaiting):
            self.awaited += 1

    def forget(self, request_id: str) -> Source | None:
        """The engine refused the request: drop its source (returned, so a peer's hold can be released)."""
        return self._sources.pop(request_id, None)

    def awaited_tokens(self, request_id: str) -> int | None:
        """The prompt tokens whose KV an Awaiting request waits for (None: it awaits nothing)."""
        source = self._sources.get(request_id)
        return source.num_tokens if isinstance(source, Awaiting) else None

    def ready(self, request_id: str, handle: KVHandle, token: int) -> None:
        """The prefill of an Awaiting request ended with ``token``: pull its KV now (or as soon as
        the engine has admitted it)."""
        source = self._sources[request_id]
        assert isinstance(source, Awaiting), f"{request_id} awaits no KV"
        self._sources[request_id] = FromPeer(handle, source.keys, token)
        if source.load is not None:
            self._start(source.load)

    def release(self, handle: KVHandle) -> None:
        """Let a prefill instance's hold go unread (the request is not here to pull it)."""
        self._release_remote(handle)

    def drop(self, request_id: str) -> None:
        """The request was aborted: nothing is imported for it any more. An awaiting load the engine
        admitted is answered now (the engine frees its blocks on that answer); a load still on its
        way is answered when it comes."""
        source = self._sources.pop(request_id, None)
        if isinstance(source, Awaiting):
            self.awaits_dropped += 1
            if source.load is not None:
                self.engine_loop.finish_load(request_id, source.load.num_cached_tokens)
                return
        if isinstance(source, FromPeer):
            self._release_remote(source.handle)
        if source is not None:
            self._dropped[request_id] = None
            while len(self._dropped) > DROPPED_KEPT:
                del self._dropped[next(iter(self._dropped))]

    def on_loads(self, loads: list[KVLoad]) -> None:
        """Engine front callback (on the event loop): start copying each admitted load (an awaiting
        one waits for ``ready``)."""
        for load in loads:
            source = self._sources.get(load.seq_id)
            if isinstance(source, Awaiting) and load.needed:
                source.load = load
            else:
                self._start(load)

    def _start(self, load: KVLoad) -> None:
        task = asyncio.create_task(self._load(load), name=f"kv-import-{load.seq_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self, load: KVLoad) -> None:
        source = self._sources.pop(load.seq_id, None)
        if not load.needed:  # the prefix cache covered it: the request runs already
            if isinstance(source, FromPeer):
                self._release_remote(source.handle)
            return
        if source is None and load.seq_id in self._dropped:  # aborted before its copy started
            del self._dropped[load.seq_id]
            self.engine_loop.finish_load(load.seq_id, load.num_cached_tokens)  # frees its blocks
            return
        token = source.token if isinstance(source, FromPeer) else None
        loaded = load.num_cached_tokens
        started = time.perf_counter()
        try:
            if isinstance(source, FromPeer):
                loaded = await self._pull(load, source)
            elif isinstance(source, FromStore):
                loaded = await self._fetch(load, source.keys)
            else:
                log.error("request %s imports KV but no source was given: computing it", load.seq_id)
        except Exception:  # noqa: BLE001 - whatever went wrong, the engine must hear back
            log.exception("importing KV for %s failed; computing it instead", load.seq_id)
        finally:
            self.engine_loop.finish_load(load.seq_id, loaded, token)
        moved = loaded - load.num_cached_tokens
        if moved > 0:
            blocks = -(-moved // self.block_size)
            self._note_transfer(blocks * self.region.block_bytes, time.perf_counter() - started)
        if loaded < load.num_tokens:
            self.failed += 1

    async def _pull(self, load: KVLoad, source: FromPeer) -> int:
        handle = source.handle
        try:
            problem = self._unlike_ours(handle)
            if problem is not None:
                # Another KV layout (model, --dtype or --block-size differ; a host whose CPU makes
                # --dtype auto pick another dtype): its bytes would be garbage here.
                self.mismatched += 1
                log.error(
                    "request %s: prefill instance %s %s: start them alike; computing the prompt here instead",
                    load.seq_id, handle.instance_id, problem,
                )  # fmt: skip
                return self._tokens(load, 0)
            last = min(len(load.block_ids), len(handle.block_ids) - load.first_block)
            pairs = [(load.block_ids[i], handle.block_ids[load.first_block + i]) for i in range(max(0, last))]
            timeout = max(0.5, min(self.timeout_s, handle.lease_s * 0.8))  # never read past the hold's lease
            got = await pull_blocks(
                self.transfer,
                self.region.name,
                handle.segment,
                handle.region,
                pairs,
                self.region.block_bytes,
                timeout,
            )
        finally:
            self._release_remote(handle)
        if self.write_behind is not None:  # their writer is the prefill instance (FromPeer)
            self.write_behind.remember(source.keys[load.first_block : load.first_block + got])
        self.pulled_blocks += got
        return self._tokens(load, got)

    def _unlike_ours(self, handle: KVHandle) -> str | None:
        """How the handle's KV differs from what our engine would compute, or None."""
        if handle.block_bytes != self.region.block_bytes:
            return (
                f"holds KV blocks of {handle.block_bytes} bytes, this instance's are {self.region.block_bytes}"
                " (the two run a different model, --dtype or --block-size)"
            )
        if handle.kv_salt != self.kv_salt:  # same size, other numbers: bfloat16 against float16
            return (
                f"computed its KV as {handle.kv_salt!r}, this instance as {self.kv_salt!r}"
                " (the two run a different model or --dtype)"
            )
        return None

    async def _fetch(self, load: KVLoad, keys: list[str]) -> int:
        if self.store is None:
            return load.num_cached_tokens
        wanted = keys[load.first_block : load.first_block + len(load.block_ids)]
        block_ids = load.block_ids[: len(wanted)]
        got = await fetch_from_store(self.store, self.region.name, wanted, block_ids, self.region.block_bytes)
        if self.write_behind is not None:
            self.write_behind.remember(wanted[:got])  # in the store already: never written back
        self.fetched_blocks += got
        return self._tokens(load, got)

    def _tokens(self, load: KVLoad, blocks: int) -> int:
        """Tokens in place once ``blocks`` leading blocks of ``load`` arrived."""
        if blocks >= len(load.block_ids):
            return load.num_tokens
        return (load.first_block + blocks) * self.block_size

    def _note_transfer(self, nbytes: int, seconds: float) -> None:
        self.transfer_bytes += nbytes
        self.transfer_seconds += seconds
        if seconds > 0:
            self.transfers.append([nbytes, seconds])
            del self.transfers[:-TRANSFERS_KEPT]

    def take_transfers(self) -> list[list[float]]:
        out, self.transfers = self.transfers, []
        return out

    async def close(self) -> None:
        tasks = list(self._tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
