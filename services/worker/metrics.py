"""Prometheus view of the engine: read from the engine thread's latest stats snapshot."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from services.worker.service import WorkerService


class EngineCollector(Collector):
    def __init__(self, service: WorkerService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        loop = self.service._loop_engine
        if loop is None:
            return
        s = loop.stats
        gauges = {
            "yutu_worker_kv_cache_usage_perc": (
                "Fraction of KV cache blocks in use (1 = full), as vLLM's",
                s.kv_usage,
            ),
            "yutu_worker_kv_blocks_total": ("KV cache blocks in the pool", s.num_kv_blocks),
            "yutu_worker_kv_blocks_free": ("KV cache blocks free (cached or empty)", s.num_free_blocks),
            "yutu_worker_num_requests_running": ("Requests in the running batch", s.num_running),
            "yutu_worker_num_requests_waiting": ("Requests queued for admission", s.num_waiting),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters: dict[str, tuple[str, float]] = {
            "yutu_worker_prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)",
                s.prefix_cache_queries_tokens,
            ),
            "yutu_worker_prefix_cache_hits": (
                "Prompt tokens served from the prefix cache (vLLM's prefix_cache_hits)",
                s.prefix_cache_hit_tokens,
            ),
            "yutu_worker_num_preemptions": ("Sequences preempted for lack of KV blocks", s.num_preemptions),
            "yutu_worker_prompt_tokens": ("Prompt tokens admitted", s.prompt_tokens_total),
            "yutu_worker_generation_tokens": ("Tokens generated", s.generation_tokens_total),
        }
        imports = self.service.imports
        if imports is not None:
            counters |= {
                "yutu_worker_kv_import_bytes": ("KV bytes imported (pulled from peers, fetched from the store)",
                                                imports.transfer_bytes),
                "yutu_worker_kv_import_seconds": ("Seconds the KV imports took", imports.transfer_seconds),
                "yutu_worker_kv_pulled_blocks": ("KV blocks pulled from prefill instances", imports.pulled_blocks),
                "yutu_worker_kv_fetched_blocks": ("KV blocks fetched from the store", imports.fetched_blocks),
                "yutu_worker_kv_awaited": ("Requests admitted while their prompt was prefilled elsewhere",
                                           imports.awaited),
                "yutu_worker_kv_awaits_dropped": ("Requests admitted awaiting KV that ended before it came",
                                                  imports.awaits_dropped),
            }  # fmt: skip
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
