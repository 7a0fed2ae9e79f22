"""The worker core: one engine behind its channel, in the mixed, prefill or decode role.

    role     channel    what a request does here
    mixed    generate   prefill + decode, streamed back as TokenDeltas (``yutu worker``)
    prefill  prefill    first token + KV handle; blocks held until the decode pulls them
    decode   generate   pull the KV (or prefill locally, or take over a migrated request), stream

Every role keeps its KV cache in a region of its transfer engine (:mod:`yutu.worker.kv_region`),
publishes its prefix cache as KV events, and -- when the deployment has a KV store -- writes new
full blocks behind the requests (:mod:`yutu.worker.write_behind`) and fetches planned prefixes
from the store (:mod:`services.worker.imports`). Prefill and decode instances send load reports to
the conductor (:mod:`services.worker.reporting`).

The generate channel: front ends (gateways) connect a DEALER to our ROUTER and multiplex requests
by id; replies go back to the identity that sent the request. If that front end is gone (ZeroMQ
cannot route to it), or pinged and then went quiet past the window its Pings declare, its
requests are aborted so their KV blocks are freed at once.

Registry record: endpoints ``generate`` or ``prefill``, ``load``, ``kv_events``,
``kv_events_replay``, ``admin``; meta (refreshed every second): ``model``, ``model_dir``,
``role``, ``max_model_len``, ``block_size``, ``block_bytes``, ``max_num_seqs``, ``segment``,
``demo``, the load, and ``broken``: None while the engine serves, else the reason it cannot (see
:mod:`services.worker.engine_loop`). A broken worker stays up to say so: ``/ready`` is 503 naming
it, requests in flight fail with ``internal_error``, new ones with ``service_unavailable``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import torch
from fastapi import APIRouter, HTTPException
from prometheus_client import Histogram
from redis.exceptions import RedisError
from yutu.engine.engine import EngineConfig, LLMEngine, RequestOutput
from yutu.engine.model_source import model_to_serve, served_model_name
from yutu.errors import ErrorKind, StartupError, YutuError
from yutu.gcpauses import PAUSE_BUCKETS
from yutu.kv.block_manager import CacheEvent
from yutu.logs import current_settings
from yutu.protocol import prefill as p
from yutu.protocol.prefill import KVHandle
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.rpc import RpcClient
from yutu.service import Service
from yutu.store.client import StoreClient, StoreClientConfig
from yutu.transfer import SegmentDirectory, TransferEngine
from yutu.transfer.tcp_wire import congestion_flag
from yutu.worker.kv_region import KVRegion
from yutu.worker.write_behind import WriteBehind

from services.worker.engine_core import EngineInfo
from services.worker.engine_loop import EngineFront, EngineLoop
from services.worker.engine_process import EngineProcess
from services.worker.generate_role import GenerateRole
from services.worker.imports import FromPeer, KVImports
from services.worker.metrics import EngineCollector
from services.worker.prefill_role import PrefillRole
from services.worker.reporting import CacheEvents, LoadReporter
from services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

_META_REFRESH_S = 1.0
_STORE_ATTACH_S = 2.0  # how often a worker without the KV store looks for a store master


class WorkerService(Service):
    def __init__(self, settings: WorkerSettings) -> None:
        self.kind = settings.kind  # before Service.__init__: its supervisor is named after it
        super().__init__()
        self.settings = settings
        self.engine: LLMEngine | None = None  # only with --engine-core thread
        self.engine_info: EngineInfo | None = None
        self.model_dir: Path | None = None
        self.served_model_name = ""
        self.demo = False
        self._loop_engine: EngineFront | None = None
        self._redis: aioredis.Redis | None = None
        self._transfer: TransferEngine | None = None
        self._region: KVRegion | None = None
        self.store: StoreClient | None = None
        self.write_behind: WriteBehind | None = None
        self.imports: KVImports | None = None
        self.cache_events: CacheEvents | None = None
        self.reporter: LoadReporter | None = None
        self.generate: GenerateRole | None = None
        self.prefill: PrefillRole | None = None
        self._release_clients: dict[str, RpcClient] = {}  # prefill control endpoint -> client
        self._registry: Registry | None = None
        self._registration: Registration | None = None
        self._accepting = False
        self.started_at = time.time()

    # -- lifecycle -------------------------------------------------------------------------------

    async def startup(self) -> None:
        s = self.settings
        self.model_dir = await asyncio.to_thread(model_to_serve, s.model)
        self._redis = aioredis.from_url(s.redis_url)
        await self._redis.ping()  # before the engine and the KV cache: a wrong --redis-url fails at once
        self._registry = Registry(self._redis, s.registry_prefix)
        self._transfer = TransferEngine(
            s.instance_id, SegmentDirectory(self._redis, s.registry_prefix), s.host, s.transfer_port,
            advertise_host=s.advertise_host, tcp_spin_us=s.busy_poll_us, tcp_congestion=s.tcp_congestion,
        )  # fmt: skip
        self._region = KVRegion(self._transfer)
        config = EngineConfig(
            model_dir=self.model_dir,
            device=s.device,
            block_size=s.block_size,
            num_kv_blocks=s.num_kv_blocks,
            kv_cache_memory_bytes=s.kv_cache_memory_mib * 2**20,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_prefill_step_tokens=s.max_prefill_step_tokens,
            max_model_len=s.max_model_len,
            enable_prefix_caching=s.enable_prefix_caching,
            dtype=s.dtype,
            prefill_threads=s.prefill_threads or None,
            kernels=s.kernels,
        )
        log.info("loading model from %s (%s role, engine in a %s)", self.model_dir, s.role, s.engine_core)
        await self._start_engine(config)
        await self._transfer.start()  # publishes the segment with the KV cache region
        assert self.engine_info is not None
        self.demo = self.engine_info.demo
        self.served_model_name = s.served_model_name or served_model_name(s.model, self.model_dir)
        if self.demo:
            log.warning(
                "serving the built-in demo model %r: random weights, its text is meaningless;"
                " serve a real checkpoint with --model /path/to/hf-dir",
                self.served_model_name,
            )
        self.metrics.register(EngineCollector(self))
        endpoints = await self._start_channel()
        if s.role != "mixed":
            assert self._loop_engine is not None
            self.reporter = LoadReporter(
                s.host, s.instance_id, s.role, self._loop_engine, s.block_size, self._report_extra, self.loops
            )
            endpoints["load"] = self._advertise(self.reporter.endpoint)
        assert self.cache_events is not None
        endpoints["kv_events"] = self._advertise(self.cache_events.publisher.endpoint)
        if self.cache_events.publisher.replay_endpoint is not None:
            endpoints["kv_events_replay"] = self._advertise(self.cache_events.publisher.replay_endpoint)
        endpoints["admin"] = self.http_url
        self._accepting = True
        if s.kv_store:
            await self._attach_store()
            if self.store is None:
                self.loops.every("kv-store-attach", _STORE_ATTACH_S, self._attach_store)
        record = ServiceRecord(self.kind, s.instance_id, endpoints, self._meta())
        self._registration = Registration(self._registry, record, s.registry_ttl_s, supervisor=self.loops)
        await self._registration.start()
        self.loops.every("worker-meta", _META_REFRESH_S, self._refresh_meta)
        log.info("%s %s serving %r: %s", s.role, s.instance_id, self.served_model_name, endpoints)

    async def _start_engine(self, config: EngineConfig) -> None:
        """Load the model and start the engine core (in a child process, or on a thread)."""
        s = self.settings
        assert self._transfer is not None and self._region is not None
        self.cache_events = CacheEvents(s.host, s.block_size, "CPU", self.loops, None)
        pin_stored = s.kv_store and s.write_behind_blocks > 0
        front: EngineFront
        if s.engine_core == "process":
            engine_pauses = Histogram(
                "yutu_engine_gc_pause_seconds",
                "How long the engine process stopped for each garbage collection (its start-up heap is"
                " frozen out of them: yutu.gcpauses)",
                ["generation"],
                registry=self.metrics,
                buckets=PAUSE_BUCKETS,
            )
            process = EngineProcess(
                config, self._region, self._on_outputs, self._on_error, on_loads=self._on_loads,
                on_cache=self._on_cache, pin_stored=pin_stored, torch_threads=s.torch_threads,
                log_settings=current_settings(),
                on_gc_pause=lambda generation, seconds: engine_pauses.labels(str(generation)).observe(seconds),
            )  # fmt: skip
            self._loop_engine = front = process
            try:
                await process.start()
            except ValueError as exc:  # the checkpoint or the engine's options (UnsupportedModelError, ...)
                raise StartupError(f"the engine cannot serve {self.model_dir}: {exc}") from exc
            assert process.task is not None and process.info is not None
            self.loops.watch("engine-events", process.task)
            self.engine_info = process.info
        else:
            if s.torch_threads > 0:
                torch.set_num_threads(s.torch_threads)
            config = dataclasses.replace(config, kv_cache_factory=self._region.factory)
            try:
                self.engine = await asyncio.to_thread(LLMEngine, config)
            except ValueError as exc:
                raise StartupError(f"the engine cannot serve {self.model_dir}: {exc}") from exc
            self.engine_info = EngineInfo.of(self.engine, torch.get_num_threads())
            thread = EngineLoop(
                self.engine, asyncio.get_running_loop(), self._on_outputs, self._on_error,
                on_loads=self._on_loads, on_cache=self._on_cache, pin_stored=pin_stored,
            )  # fmt: skip
            self._loop_engine = front = thread
            thread.start()
        assert self.engine_info is not None
        if s.prefault:
            await self._prefault()
        self.imports = KVImports(
            front, self._transfer, self._region, None, None, s.block_size, self._release_remote,
            kv_salt=self.engine_info.kv_salt,
        )  # fmt: skip

    async def _prefault(self) -> None:
        """Fault the KV cache's pages in (off the loop), before any request writes a block: a
        block's first write is otherwise a page fault per 4 KiB page (~5 us in a VM here) on the
        prefill or the KV pull that writes it."""
        assert self._region is not None and self._region.region is not None
        await asyncio.to_thread(self._region.region.fault_in, "KV cache")

    async def _start_channel(self) -> dict[str, str]:
        s = self.settings
        info = self.engine_info
        assert self._loop_engine is not None and info is not None and self.imports is not None
        assert self._region is not None
        if s.role == "prefill":
            self.prefill = PrefillRole(
                self._loop_engine, self.imports, self._region, s.instance_id, info.root_key,
                s.block_size, s.kv_lease_s, s.host, s.zmq_port, s.advertise_host, self._check_prompt,
            )  # fmt: skip
            await self.prefill.start()
            self.loops.every("kv-holds", 1.0, self.prefill.expire)
            return {"prefill": self.prefill.endpoint, "prefill_stream": self.prefill.stream_endpoint}
        self.generate = GenerateRole(
            self._loop_engine, self.imports, info.root_key, s.block_size, s.host, s.zmq_port,
            self._check_prompt, self.loops,
        )  # fmt: skip
        return {"generate": self._advertise(self.generate.endpoint)}

    def _advertise(self, endpoint: str) -> str:
        return endpoint.replace(self.settings.host, self.settings.advertise_host, 1)

    async def _attach_store(self) -> None:
        """Use the KV store once a store master is registered (write-behind, fetches)."""
        if self.store is not None or self._registry is None or self._transfer is None:
            return
        try:
            if not await self._registry.list("store-master"):
                if not self.loops.tasks.get("kv-store-attach"):
                    log.info("no KV store master registered (yet): running without the store for now")
                return
        except (RedisError, OSError) as exc:
            log.warning("cannot look for the KV store master: %s", exc)
            return
        s = self.settings
        store = StoreClient(
            StoreClientConfig(
                s.redis_url, s.registry_prefix, client_id=s.instance_id, spin_us=s.busy_poll_us
            ),
            self._transfer,
        )
        try:
            await store.start()
        except (YutuError, OSError, RedisError) as exc:
            log.warning("the KV store is not usable yet (%s); retrying", exc)
            await store.close()
            return
        assert self._region is not None and self._loop_engine is not None and self.imports is not None
        self.store = store
        if s.write_behind_blocks > 0:
            self.write_behind = WriteBehind(
                store, self._region.name, self._region.block_bytes, self._loop_engine.unpin, self.loops,
                max_in_flight=s.write_behind_blocks, busy=self._prefilling, max_defer_s=s.write_behind_defer_s,
            )  # fmt: skip
        self.imports.store = store
        self.imports.write_behind = self.write_behind
        task = self.loops.tasks.get("kv-store-attach")
        if task is not None:
            task.cancel()
        log.info("using the KV store (write-behind %s)", "on" if self.write_behind else "off")

    async def drain(self) -> None:
        self._accepting = False
        if self.generate is not None:
            self.generate.accepting = False
        if self.prefill is not None:
            self.prefill.accepting = False
        if self._registration is not None:
            await self._registration.close()  # front ends stop picking us first
            self._registration = None
        # Polling is fine here: drain happens once, and it keeps the hot path free of bookkeeping.
        while self.in_flight:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if self.write_behind is not None:
            await self.write_behind.flush(5.0)

    async def shutdown(self) -> None:
        self._accepting = False
        if self._registration is not None:
            await self._registration.close()
        if self.prefill is not None:
            await self.prefill.close()
        if self.generate is not None:
            self.generate.close()
        if self._loop_engine is not None:
            await self._loop_engine.stop()
        if self.imports is not None:
            await self.imports.close()
        if self.write_behind is not None:
            self.write_behind.close()
        for client in self._release_clients.values():
            await client.close()
        if self.reporter is not None:
            self.reporter.close()
        if self.cache_events is not None:
            await self.cache_events.close()
        if self.store is not None:
            await self.store.close()
        if self._transfer is not None:
            await self._transfer.close()  # unlinks the KV cache region
        if self._redis is not None:
            await self._redis.aclose()

    def is_ready(self) -> bool:
        # A broken engine is not "not ready yet": problems() names it (and an engine process
        # that ended is not alive).
        front = self._loop_engine
        return self._accepting and front is not None and (front.alive or front.broken is not None)

    @property
    def in_flight(self) -> int:
        held = 0 if self.prefill is None else len(self.prefill.holds)
        running = self.generate.in_flight if self.generate is not None else 0
        return running + (0 if self.prefill is None else self.prefill.in_flight) + held

    # -- from the engine thread ------------------------------------------------------------------

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        if self.prefill is not None:
            for out in outputs:
                self.prefill.on_output(out)
        elif self.generate is not None:
            self.generate.on_outputs(outputs)

    def _on_error(self, request_id: str, exc: BaseException) -> None:
        """A request failed (its kind from the error), or, with no id, the engine is broken."""
        if not request_id:
            error = YutuError(f"worker engine failed: {exc}", ErrorKind.INTERNAL)
            if self.prefill is not None:
                self.prefill.fail_all(error)
            if self.generate is not None:
                self.generate.fail_all(error)
            if self._registration is not None:
                self._registration.update_meta(**self._meta())
            return
        source = self.imports.forget(request_id) if self.imports is not None else None
        if isinstance(source, FromPeer):
            self._release_remote(source.handle)
        if self.prefill is not None:
            self.prefill.on_error(request_id, _as_yutu(exc))
        elif self.generate is not None:
            self.generate.on_error(request_id, _as_yutu(exc))

    def _on_loads(self, loads: Any) -> None:
        assert self.imports is not None
        self.imports.on_loads(loads)

    def _on_cache(self, events: list[CacheEvent], pinned: list[tuple[bytes, int]]) -> None:
        assert self.cache_events is not None and self._loop_engine is not None
        self.cache_events.write_behind = self.write_behind
        if pinned and self.write_behind is None:  # no store (yet): nothing copies them
            self._loop_engine.unpin([block_id for _, block_id in pinned])
            pinned = []
        self.cache_events.on_cache(events, pinned)

    def _release_remote(self, handle: KVHandle) -> None:
        """Tell a prefill instance we are done with its hold (best effort: its lease ends it anyway).
        The hold is named by the handle: this instance may run the request under another id."""
        client = self._release_clients.get(handle.control)
        if client is None:
            client = self._release_clients[handle.control] = RpcClient(p.CHANNEL, handle.control, 5.0)
        task = asyncio.ensure_future(client.call(p.ReleaseKV(handle.hold_id)))
        task.add_done_callback(_log_release_failure)

    def _check_prompt(self, ids: Any) -> str | None:
        assert self.engine_info is not None
        vocab = self.engine_info.vocab_size
        # set/min/max look at the ids at C speed (a genexpr was ~80 us for 1,024 ids)
        if (
            not isinstance(ids, list)
            or not ids
            or set(map(type, ids)) != {int}
            or min(ids) < 0
            or max(ids) >= vocab
        ):
            return f"prompt must be a non-empty list of token ids in [0, {vocab})"
        return None

    def _report_extra(self) -> tuple[int, list[list[float]]]:
        held = 0 if self.prefill is None else len(self.prefill.holds)
        transfers = [] if self.imports is None else self.imports.take_transfers()
        return held, transfers

    def _prefilling(self) -> bool:
        """Whether the engine has prompts to prefill, as of its last step (write-behind waits then)."""
        return self._loop_engine is not None and self._loop_engine.stats.num_prefilling > 0

    @property
    def broken(self) -> str | None:
        """Why the engine cannot serve any more, or None (see the module docstring)."""
        return self._loop_engine.broken if self._loop_engine is not None else None

    def problems(self) -> list[str]:
        reasons = super().problems()
        if self.broken is not None:
            reasons.append(f"engine broken: {self.broken}")
        return reasons

    # -- registry, admin -------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        info = self.engine_info
        assert info is not None and self._loop_engine is not None
        stats = self._loop_engine.stats
        return {
            "model": self.served_model_name,
            "model_dir": str(self.model_dir),
            "role": self.settings.role,
            "max_model_len": info.max_model_len,
            "block_size": self.settings.block_size,
            "block_bytes": 0 if self._region is None else self._region.block_bytes,
            "dtype": info.dtype,
            "device": info.device,
            "kv_salt": info.kv_salt,  # what block keys are salted with (model and dtype)
            "max_num_seqs": self.settings.max_num_seqs,
            "max_num_batched_tokens": self.settings.max_num_batched_tokens,  # its prefill chunk
            "max_prefill_step_tokens": self.settings.max_prefill_step_tokens,  # when nothing decodes
            "segment": self.settings.instance_id,
            "kv_store": self.store is not None,
            "demo": self.demo,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_usage": stats.kv_usage,
            "broken": self.broken,
        }

    def _refresh_meta(self) -> None:
        """One step of the ``worker-meta`` loop: the next heartbeat writes the current load."""
        if self._registration is not None:
            self._registration.update_meta(**self._meta())

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "kind": self.kind,
            "role": self.settings.role,
            "instance_id": self.settings.instance_id,
        }
        engine = self.engine_info
        if engine is not None and self._loop_engine is not None:
            stats = self._loop_engine.stats
            info |= {
                "model": self.served_model_name,
                "model_dir": str(self.model_dir),
                "demo": self.demo,
                "max_model_len": engine.max_model_len,
                "block_size": self.settings.block_size,
                "torch_threads": engine.torch_threads,
                "prefill_threads": engine.prefill_threads,
                "busy_poll_us": self.settings.busy_poll_us,
                "tcp_congestion": congestion_flag(self.settings.tcp_congestion),
                "engine_core": self.settings.engine_core,
                "engine_pid": self._loop_engine.pid,
                "engine_gc_frozen_objects": engine.gc_frozen_objects,  # None: the engine is on a thread
                "dtype": engine.dtype,
                "kernels": engine.kernels,
                "in_flight": self.in_flight,
                "broken": self.broken,
                "engine": asdict(stats),
                "kv_store": self.store is not None,
                "cached_blocks": 0 if self.cache_events is None else len(self.cache_events.keys),
                "uptime_s": round(time.time() - self.started_at, 3),
            }
            if self.write_behind is not None:
                info["write_behind"] = asdict(self.write_behind.stats) | {
                    "in_flight": self.write_behind.in_flight
                }
            if self.imports is not None:
                info["imports"] = {
                    "pulled_blocks": self.imports.pulled_blocks,
                    "fetched_blocks": self.imports.fetched_blocks,
                    "short": self.imports.failed,
                    "mismatched": self.imports.mismatched,  # handles of another KV layout, computed here
                    "awaited": self.imports.awaited,  # admitted while their prompt was prefilled elsewhere
                    "awaits_dropped": self.imports.awaits_dropped,  # of those, ended before their KV came
                }
            if self.prefill is not None:
                holds = self.prefill.holds
                info["holds"] = {"held": len(holds), "released": holds.released, "expired": holds.expired,
                                 "undelivered": holds.undelivered}  # fmt: skip
        return info

    def admin_router(self) -> APIRouter:
        router = APIRouter()

        @router.post("/debug/check_integrity")
        async def check_integrity() -> dict[str, Any]:
            """The block manager's invariants, checked by the engine core between two steps: 200
            with the counts, 500 naming a broken invariant, 503 when the engine is not running."""
            assert self._loop_engine is not None
            try:
                return await self._loop_engine.check()
            except RuntimeError as exc:
                raise HTTPException(503, str(exc)) from exc

        return router


def _as_yutu(exc: BaseException) -> YutuError:
    if isinstance(exc, YutuError):
        return exc
    return YutuError(str(exc), ErrorKind.INVALID_REQUEST)  # the engine's ValueErrors: bad input


def _log_release_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("releasing a prefill hold failed (its lease will end it): %s", task.exception())
