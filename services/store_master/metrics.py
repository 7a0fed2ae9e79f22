"""Prometheus metrics of the store master: op counts and latencies, plus gauges read from the
state at scrape time (capacity, used, objects, evictions, ...)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from yutu.rpc import KVEventPublisher

    from services.store_master.persistence import Persister
    from services.store_master.service import StoreMasterService
    from services.store_master.state import MasterState


def collect_stats(
    state: MasterState, persister: Persister | None, events: KVEventPublisher | None
) -> dict[str, Any]:
    """The numbers /stats, /metrics and GetStats report."""
    c = state.counters
    segments = state.segments.segments.values()
    return {
        "eviction_policy": state.eviction.name,
        "capacity": state.segments.capacity,
        "used": state.segments.used_bytes,
        "usage": round(state.segments.usage, 6),
        "fragmentation": round(state.segments.fragmentation(), 6),
        "segments": len(state.segments),
        "objects": sum(1 for e in state.objects.values() if e.readable),
        "pending_puts": sum(1 for e in state.objects.values() if e.pending is not None),
        "reserved_puts": len(state.reserved),
        "retired_extents": len(state.retired),
        "disk_capacity": sum(s.disk_capacity for s in segments),
        "disk_used": sum(s.disk_used for s in segments),
        "evicted_objects": c.evicted_objects,
        "evicted_bytes": c.evicted_bytes,
        "eviction_rounds": c.eviction_rounds,
        "reclaimed_puts": c.reclaimed_puts,
        "lost_objects": c.lost_objects,
        "offloaded_objects": c.offloaded_objects,
        "promoted_objects": c.promoted_objects,
        "metadata_writes": 0 if persister is None else persister.writes,
        "published_events": 0 if events is None else events.published_events,
    }


_GAUGES = {
    "capacity": "bytes of DRAM contributed by mounted segments",
    "used": "bytes allocated in segments (complete, being written and retired)",
    "usage": "used / capacity",
    "fragmentation": "free-byte-weighted 1 - largest free range / free bytes",
    "segments": "mounted segments",
    "objects": "readable objects",
    "pending_puts": "puts started and not yet ended",
    "reserved_puts": "reservations: space held for writers' next puts, not yet committed",
    "disk_capacity": "bytes of disk tier offered by nodes",
    "disk_used": "bytes of objects in disk tiers",
}
_COUNTERS = {
    "evicted_objects": "objects evicted (removed or moved to disk)",
    "evicted_bytes": "DRAM bytes evicted",
    "eviction_rounds": "eviction rounds run",
    "reclaimed_puts": "puts reclaimed after their writer timed out",
    "lost_objects": "objects lost because every replica's node died",
    "offloaded_objects": "objects moved to a disk tier",
    "promoted_objects": "objects brought back from a disk tier",
}


class _StateCollector(Collector):
    def __init__(self, service: StoreMasterService) -> None:
        self.service = service

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.service.stats()
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"yutu_store_{name}", doc, value=float(stats[name]))
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"yutu_store_{name}", doc, value=float(stats[name]))


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry, service: StoreMasterService) -> None:
        self.ops = Counter(
            "yutu_store_ops", "store master RPCs by op and outcome", ["op", "outcome"], registry=registry
        )
        self.latency = Histogram(
            "yutu_store_op_latency_seconds",
            "store master RPC handling time by op",
            ["op"],
            registry=registry,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
        )
        registry.register(_StateCollector(service))
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}  # label lookups, done once

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        children = self._children.get((op, outcome))
        if children is None:
            children = self._children[(op, outcome)] = (self.ops.labels(op, outcome), self.latency.labels(op))
        children[0].inc()
        children[1].observe(seconds)
