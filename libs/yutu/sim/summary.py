"""The numbers of one run: latency distributions, SLO attainment, goodput, cache hits, rejections.

Definitions (what ``summary.json`` holds):
- ``ttft_*``: first token minus arrival, over the requests that got a first token and finished;
- ``tbt_*``: per request, the mean of its longest 10% gaps between the tokens its decode instance
  emitted (the paper's TBT); ``handoff_*``: the gap from the prefill's first token to the decode's
  first (KV transfer and the wait for a batch slot), kept out of the TBT; ``tpot``: the mean gap;
- a request is *good* when it finished with TTFT <= the TTFT SLO and TBT <= the TBT SLO (an SLO not
  set passes everyone); ``slo_attainment`` = good / requests (rejected ones count as missed), which is
  the paper's "effective request ratio"; ``goodput_rps`` = good / the trace's arrival span;
- ``cache_hit_ratio``: prompt tokens reused (local cache and store) / prompt tokens, over prefilled
  requests; ``local_hit_ratio`` and ``store_hit_ratio`` split it;
- ``prefill_compute_s``: compute and fetch time of every prefill run, ``wasted_prefill_s`` the part
  spent on requests then refused by their decode instance.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from yutu.sim.record import RequestRecord
from yutu.sim.simulator import Simulation


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of ``values`` (0.0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def significant(value: float) -> float:
    """``value`` to 6 significant digits (summary.json stays readable and stable)."""
    return float(f"{value:.6g}")


def is_good(r: RequestRecord, slo_ttft_s: float | None, slo_tbt_s: float | None) -> bool:
    if not r.completed or r.rejected is not None:
        return False
    ttft, tbt = r.ttft_s, r.tbt_s
    assert ttft is not None and tbt is not None
    return (slo_ttft_s is None or ttft <= slo_ttft_s) and (slo_tbt_s is None or tbt <= slo_tbt_s)


def summarise(sim: Simulation) -> dict[str, Any]:
    cfg, records = sim.config, list(sim.records.values())
    done = [r for r in records if r.completed and r.rejected is None]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tbt = [r.tbt_s for r in done if r.tbt_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None and r.output_len > 1]
    handoff = [r.handoff_s for r in done if r.handoff_s is not None and r.output_len > 1]
    good = sum(1 for r in records if is_good(r, cfg.slo_ttft_s, cfg.slo_tbt_s))
    arrivals = [r.arrival_s for r in records]
    span = max(arrivals) - min(arrivals)
    prefilled = [r for r in records if r.first_token_s is not None]
    prompt = sum(r.prompt_len for r in prefilled)
    bs = sim.profile.block_size
    local = sum(r.local_blocks for r in prefilled) * bs
    fetched = sum(r.fetched_blocks for r in prefilled) * bs
    causes = Counter(r.rejected for r in records if r.rejected is not None)
    out: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "rejected": sum(causes.values()),
        "rejected_by_cause": dict(sorted(causes.items())),
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "tbt_mean_s": _mean(tbt),
        "tbt_p50_s": percentile(tbt, 50),
        "tbt_p99_s": percentile(tbt, 99),
        "tpot_mean_s": _mean(tpot),
        "handoff_mean_s": _mean(handoff),
        "handoff_p99_s": percentile(handoff, 99),
        "slo_ttft_s": cfg.slo_ttft_s,
        "slo_tbt_s": cfg.slo_tbt_s,
        "good": good,
        "slo_attainment": good / len(records),
        "goodput_rps": good / span if span > 0 else float(good),
        "trace_span_s": span,
        "makespan_s": max((r.finish_s for r in done if r.finish_s is not None), default=0.0) - min(arrivals),
        "cache_hit_ratio": (local + fetched) / prompt if prompt else 0.0,
        "local_hit_ratio": local / prompt if prompt else 0.0,
        "store_hit_ratio": fetched / prompt if prompt else 0.0,
        "prefill_compute_s": math.fsum(r.prefill_s + r.transfer_s for r in prefilled),
        "wasted_prefill_s": sim.wasted_prefill_s,
        "local_prefills": sum(1 for r in records if r.decode_id is not None and r.prefill_id is None),
        "store_blocks": len(sim.store),
        "store_evictions": sim.store.evictions,
        "events": sim.events,
        "config": {
            "prefill": cfg.prefill,
            "decode": cfg.decode,
            "policy": cfg.policy,
            "profile": cfg.profile.name,
            "rejection": str(cfg.rejection),
            "balancing_threshold": cfg.balancing_threshold,
            "disagg_threshold": cfg.disagg_threshold,
            "prefill_stealing": cfg.prefill_stealing,
            "store_capacity_blocks": cfg.store_capacity_blocks,
            "cache_blocks": cfg.local_cache_blocks,
            "eviction_policy": cfg.eviction_policy,
            "seed": cfg.seed,
            "jitter": cfg.jitter,
            "learn_costs": cfg.learn_costs,
            "network_bps": cfg.profile.network_bps,
        },
    }
    return {k: significant(v) if isinstance(v, float) else v for k, v in out.items()}
