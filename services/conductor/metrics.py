"""The conductor's Prometheus metrics (``/metrics`` on its admin port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ConductorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.placements = Counter(
            "yutu_conductor_placements_total",
            "requests placed, by policy and by the prefill and decode instances chosen",
            ["policy", "prefill", "decode"],
            registry=registry,
        )
        self.rejections = Counter(
            "yutu_conductor_rejections_total",
            "requests rejected, by cause",
            ["policy", "cause"],
            registry=registry,
        )
        self.replications = Counter(
            "yutu_conductor_replications_total",
            "placements that fetch a prefix from the store into another instance's cache (hot prefixes)",
            registry=registry,
        )
        self.local_prefills = Counter(
            "yutu_conductor_local_prefills_total",
            "placements where the decode instance prefills itself (conditional disaggregation)",
            registry=registry,
        )
        self.ttft_error = Histogram(
            "yutu_conductor_ttft_prediction_error_seconds",
            "measured minus predicted TTFT of placed requests",
            buckets=(-5, -1, -0.5, -0.2, -0.1, -0.05, -0.02, 0, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 5),
            registry=registry,
        )
        self.instances = Gauge(
            "yutu_conductor_instances", "live instances the conductor places on", ["role"], registry=registry
        )
        self.place_seconds = Histogram(
            "yutu_conductor_place_seconds",
            "time to compute one placement",
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
            registry=registry,
        )
