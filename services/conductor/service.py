"""The conductor: the KV-cache-centric global scheduler.

    registry poll  -> GlobalView.update_records; follow each instance's load reports and KV events
    load reports   -> GlobalView.on_report; cost models observe the measured times
    KV events      -> GlobalView.on_kv_events (instances' prefix caches, and the store's keys)
    Place (RPC)    -> policy.place(view.snapshot(now), request, now) -> Placement | Rejected
    Observed (RPC) -> RecentPlacements (predicted vs measured TTFT); the decode has the request
    Finished (RPC) -> GlobalView.request_done: the request counts on no instance any more

The policy code is :mod:`yutu.sched` (pure; the simulator drives the same code). After a restart
the view is rebuilt from the registry and KV-event replays (each instance answers a replay from
the start with a snapshot of its cache), with no restart of anything else. While the conductor is
down, gateways place requests themselves (least loaded) and count it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Header, HTTPException
from pydantic import BaseModel
from redis.exceptions import RedisError
from yutu.errors import ErrorKind, YutuError
from yutu.protocol import conductor as c
from yutu.protocol.kv_events import KVEventBatch
from yutu.protocol.load import CHANNEL as LOAD
from yutu.protocol.load import LoadReport
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.rpc import KVEventSubscriber, RpcServer, Subscriber
from yutu.rpc.stream import StreamRpcServer
from yutu.sched import CostModels, Placement, Placer, PolicyOptions, Rejection, RequestView, policy_by_name
from yutu.service import Service

from services.conductor.correction import TTFTCorrection
from services.conductor.metrics import ConductorMetrics
from services.conductor.recent import PlacementRecord, RecentPlacements
from services.conductor.settings import ConductorSettings
from services.conductor.view import ROLES, STORE, GlobalView

log = logging.getLogger(__name__)


class PolicyChange(BaseModel):
    policy: str
    balancing_threshold: float | None = None
    disagg_threshold: int | None = None
    prefill_stealing: bool | None = None
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None


class ConductorService(Service):
    kind = "conductor"

    def __init__(self, settings: ConductorSettings) -> None:
        super().__init__()
        self.settings = settings
        self.view = GlobalView(settings.block_size, settings.report_stale_s)
        self.costs = CostModels()
        self.options = settings.options
        self.policy: Placer = policy_by_name(settings.policy, costs=self.costs, **_options(settings.options))
        self.recent = RecentPlacements(settings.recent)
        self.correction = TTFTCorrection()
        self.stats = ConductorMetrics(self.metrics)
        self._rpc: RpcServer | None = None
        self._stream: StreamRpcServer | None = None  # the same channel without ZeroMQ's thread hops
        self._loads: Subscriber | None = None
        self._events: KVEventSubscriber | None = None
        self._registry: Registry | None = None
        self._registration: Registration | None = None
        self._registry_ok = False
        self.started_at = time.time()

    async def startup(self) -> None:
        s = self.settings
        self._registry = Registry.from_url(s.redis_url, s.registry_prefix)
        await self._registry.ping()
        self._rpc = RpcServer(c.CHANNEL, self._handle, s.host, s.port)
        self._rpc.start()
        if s.stream_port is not None:
            self._stream = StreamRpcServer(c.CHANNEL, self._handle, s.host, s.stream_port)
            await self._stream.start()
        self._loads = Subscriber(LOAD, self._on_report)
        self._events = KVEventSubscriber(self._on_kv_events, self.view.reset_keys)
        await self._refresh()
        self.loops.every("conductor-registry", s.registry_poll_s, self._refresh)
        endpoint = self._rpc.endpoint.replace(s.host, s.advertise_host, 1)
        endpoints = {"rpc": endpoint, "admin": self.http_url}
        if self._stream is not None:
            endpoints["rpc_stream"] = self._stream.endpoint.replace(s.host, s.advertise_host, 1)
        record = ServiceRecord(self.kind, s.instance_id, endpoints, {"policy": s.policy})
        self._registration = Registration(self._registry, record, s.registry_ttl_s, supervisor=self.loops)
        await self._registration.start()
        log.info("conductor %s on %s, policy %s (%s)", s.instance_id, endpoint, s.policy, self.options)

    async def drain(self) -> None:
        if self._registration is not None:
            await self._registration.close()
            self._registration = None

    async def shutdown(self) -> None:
        if self._registration is not None:
            await self._registration.close()
        if self._rpc is not None:
            await self._rpc.close()
        if self._stream is not None:
            await self._stream.close()
        if self._loads is not None:
            self._loads.close()
        if self._events is not None:
            await self._events.close()
        if self._registry is not None:
            await self._registry.close()

    def is_ready(self) -> bool:
        return self._rpc is not None and self._registry_ok

    # -- the view's feeds ---------------------------------------------------------------------------

    async def _refresh(self) -> None:
        assert self._registry is not None and self._loads is not None and self._events is not None
        try:
            records = [r for kind in ROLES for r in await self._registry.list(kind)]
            masters = await self._registry.list("store-master")
        except (RedisError, OSError) as exc:
            self._registry_ok = False
            log.warning("cannot read the registry (keeping the last known instances): %s", exc)
            return
        self._registry_ok = True
        joined, left = self.view.update_records(records)
        for instance_id in left:
            log.info("instance %s left", instance_id)
            self._loads.unfollow(instance_id)
            self._events.unfollow(instance_id)
        for record in records:
            self._follow(record.instance_id, record, restart=record.instance_id in joined)
        if masters:
            self._follow(STORE, masters[0], restart=False)
        elif STORE in self._events.sources:
            self._events.unfollow(STORE)
            self.view.reset_keys(STORE)
        for role in ROLES:
            self.stats.instances.labels(role).set(
                sum(1 for i in self.view.instances.values() if i.role == role)
            )

    def _follow(self, name: str, record: ServiceRecord, restart: bool) -> None:
        assert self._loads is not None and self._events is not None
        load = record.endpoints.get("load")
        if load is not None and (restart or not self._loads.follows(name, load)):
            self._loads.follow(name, load)
        events = record.endpoints.get("kv_events")
        if events is not None and (restart or not self._events.follows(name, events)):
            if restart:
                log.info("%s %s joined: following its load reports and KV events", record.kind, name)
            self._events.follow(name, events, record.endpoints.get("kv_events_replay"))

    def _on_report(self, source: str, msg: Any) -> None:
        if not isinstance(msg, LoadReport) or msg.instance_id != source:
            log.warning("dropping a load message from %s: %r", source, type(msg).__name__)
            return
        if not self.view.on_report(msg, time.monotonic()):
            return
        for row in msg.prefills:
            self.costs.prefill.observe(int(row[0]), int(row[1]), float(row[2]))
        for row in msg.steps:
            self.costs.decode.observe(int(row[0]), int(row[1]), float(row[2]))
        for row in msg.transfers:
            self.costs.transfer.observe(int(row[0]), float(row[1]))
        # Here, not in the next placement: a fit is ~0.5-1 ms of numpy over the window, and with
        # decode steps reported continuously nearly every placement found the models changed.
        self.costs.fit()

    def _on_kv_events(self, source: str, batch: KVEventBatch) -> None:
        self.view.on_kv_events(source, batch)

    # -- the conductor channel -----------------------------------------------------------------------

    def _handle(self, msg: Any) -> Any:
        if isinstance(msg, c.Place):
            return self._place(msg)
        if isinstance(msg, c.Observed):
            self.view.prefill_done(msg.request_id, time.monotonic())
            record = self.recent.observe(msg.request_id, msg.ttft_s, msg.cached_tokens)
            if record is not None:
                self.stats.ttft_error.observe(msg.ttft_s - record.predicted_ttft_s)
                self.correction.observe(record.predicted_ttft_s, msg.ttft_s)
                self._apply_correction()
            return c.Ack(msg.request_id)
        if isinstance(msg, c.Finished):
            self.view.request_done(msg.request_id)
            return c.Ack(msg.request_id)
        raise YutuError(
            f"unexpected {type(msg).__name__} on the conductor channel", ErrorKind.INVALID_REQUEST
        )

    def _place(self, msg: c.Place) -> c.Placement | c.Rejected:
        started = time.perf_counter()
        if not isinstance(msg.block_keys, list) or not all(isinstance(k, str) for k in msg.block_keys):
            raise YutuError("block_keys must be a list of hex strings", ErrorKind.INVALID_REQUEST)
        try:
            request = RequestView(
                msg.request_id,
                tuple(msg.block_keys),
                msg.prompt_len,
                msg.max_tokens,
                msg.waited_s,
                msg.priority,
            )
        except ValueError as exc:
            raise YutuError(str(exc), ErrorKind.INVALID_REQUEST) from None
        now = time.monotonic()
        view = self.view.snapshot(now, frozenset(msg.exclude))
        try:
            outcome = self.policy.place(view, request, now)
        except ValueError as exc:
            raise YutuError(str(exc), ErrorKind.INVALID_REQUEST) from None
        self.stats.place_seconds.observe(time.perf_counter() - started)
        if isinstance(outcome, Rejection):
            self.stats.rejections.labels(self.policy.name, str(outcome.cause)).inc()
            return c.Rejected(
                msg.request_id, outcome.error_kind.value, outcome.reason, outcome.retry_after_s,
                outcome.ttft_s or 0.0, outcome.tbt_s or 0.0,
            )  # fmt: skip
        return self._accept(outcome, request)

    def _accept(self, placement: Placement, request: RequestView) -> c.Placement:
        self.view.note_placement(placement, request, time.monotonic())
        plan = placement.plan
        self.stats.placements.labels(
            self.policy.name, placement.prefill_id or "none", placement.decode_id
        ).inc()
        if plan.fetch_blocks and placement.prefill_id is not None:
            self.stats.replications.inc()
        if placement.prefill_id is None:
            self.stats.local_prefills.inc()
        self.recent.add(
            PlacementRecord(
                request.request_id, time.time(), self.policy.name, placement.prefill_id, placement.decode_id,
                request.prompt_len, plan.local_blocks, plan.fetch_end, placement.ttft_s, placement.tbt_s,
                placement.reason, request.priority,
            )
        )  # fmt: skip
        return c.Placement(
            request.request_id, placement.prefill_id, placement.decode_id, plan.local_blocks, plan.fetch_end,
            plan.compute_tokens, placement.ttft_s, placement.tbt_s, self.policy.name, placement.reason,
        )  # fmt: skip

    # -- admin --------------------------------------------------------------------------------------

    def _apply_correction(self) -> None:
        """Hold the policy to the TTFT SLO divided by how much measured TTFTs exceed predictions."""
        slo = self.options.slo_ttft_s
        if slo is not None:
            self.policy.options = replace(self.options, slo_ttft_s=slo / self.correction.factor)

    def set_policy(self, change: PolicyChange) -> None:
        o = self.options
        options = PolicyOptions(
            balancing_threshold=o.balancing_threshold
            if change.balancing_threshold is None
            else change.balancing_threshold,
            disagg_threshold=o.disagg_threshold
            if change.disagg_threshold is None
            else change.disagg_threshold,
            prefill_stealing=o.prefill_stealing
            if change.prefill_stealing is None
            else change.prefill_stealing,
            slo_ttft_s=o.slo_ttft_s if change.slo_ttft_ms is None else change.slo_ttft_ms / 1000,
            slo_tbt_s=o.slo_tbt_s if change.slo_tbt_ms is None else change.slo_tbt_ms / 1000,
        )
        self.policy = policy_by_name(change.policy, costs=self.costs, **_options(options))
        self.options = options
        self._apply_correction()
        log.info("policy changed to %s (%s)", change.policy, options)

    def describe_policy(self) -> dict[str, Any]:
        o = self.options
        return {
            "policy": self.policy.name,
            "balancing_threshold": o.balancing_threshold,
            "disagg_threshold": o.disagg_threshold,
            "prefill_stealing": o.prefill_stealing,
            "slo_ttft_ms": None if o.slo_ttft_s is None else o.slo_ttft_s * 1000,
            "slo_tbt_ms": None if o.slo_tbt_s is None else o.slo_tbt_s * 1000,
            "ttft_correction": round(self.correction.factor, 3),  # measured / predicted TTFT, smoothed
        }

    def describe_instances(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        live = {i.instance_id for role in ROLES for i in self.view.live(role, now)}
        out = []
        for instance in sorted(self.view.instances.values(), key=lambda i: i.instance_id):
            report = instance.report
            out.append(
                {
                    "instance_id": instance.instance_id,
                    "role": instance.role,
                    "live": instance.instance_id in live,
                    "broken": instance.broken,
                    "endpoints": instance.record.endpoints,
                    "cached_blocks": len(instance.cached),
                    "pending": len(instance.pending),
                    "report_age_s": None
                    if instance.report_at is None
                    else round(now - instance.report_at, 3),
                    "load": None
                    if report is None
                    else {
                        "running": report.num_running,
                        "waiting": report.num_waiting,
                        "held": report.num_held,
                        "free_blocks": report.free_blocks,
                        "total_blocks": report.total_blocks,
                        "queued_prefills": len(report.queued),
                    },
                }
            )
        return out

    def info(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "instance_id": self.settings.instance_id,
            "rpc": None if self._rpc is None else self._rpc.endpoint,
            **self.describe_policy(),
            "instances": len(self.view.instances),
            "store_blocks": len(self.view.store_keys),
            "uptime_s": round(time.time() - self.started_at, 3),
        }

    def admin_router(self) -> APIRouter:
        router = APIRouter()

        @router.get("/instances")
        async def instances() -> dict[str, Any]:
            return {"instances": self.describe_instances(), "store_blocks": len(self.view.store_keys)}

        @router.get("/policy")
        async def get_policy() -> dict[str, Any]:
            return self.describe_policy()

        @router.put("/policy")
        async def put_policy(
            change: PolicyChange, authorization: str | None = Header(default=None)
        ) -> dict[str, Any]:
            token = self.settings.admin_token
            if token is None:
                raise HTTPException(
                    403, "the policy is fixed: start the conductor with --admin-token to change it"
                )
            if authorization != f"Bearer {token}":
                raise HTTPException(401, "missing or wrong admin token (Authorization: Bearer <token>)")
            try:
                self.set_policy(change)
            except ValueError as exc:
                raise HTTPException(400, str(exc)) from None
            return self.describe_policy()

        @router.get("/placements/recent")
        async def recent(limit: int = 50) -> dict[str, Any]:
            return {"placements": self.recent.latest(max(1, min(limit, self.settings.recent)))}

        return router


def _options(options: PolicyOptions) -> dict[str, Any]:
    return {
        "balancing_threshold": options.balancing_threshold,
        "disagg_threshold": options.disagg_threshold,
        "prefill_stealing": options.prefill_stealing,
        "slo_ttft_s": options.slo_ttft_s,
        "slo_tbt_s": options.slo_tbt_s,
    }
