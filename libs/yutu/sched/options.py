"""Options every placement policy shares, validated once when the policy is built."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyOptions:
    """Knobs of the shared placement steps.

    balancing_threshold: an instance considers fetching the store's blocks beyond its local prefix
        only when ``reach / local > balancing_threshold`` (always when ``local == 0``); then the
        fetch-or-recompute cost test (Eq. 2) decides whether the fetch pays. Algorithm 1's
        kvcache_balancing_threshold, applied in the prefix plan every policy shares. 1.0 leaves the
        decision to the cost test alone; larger values keep small gains local.
    disagg_threshold: conditional disaggregation. When at most this many prompt tokens remain
        uncached after the decode instance's own cache and the store, the decode instance prefills
        them itself. 0 turns it off.
    prefill_stealing: a decode instance takes a request's prefill off a prefill instance's queue when
        it would finish it sooner and the time saved exceeds the delay it adds to the sequences
        decoding there (``yutu.sched.placer``, step 5). Off by default: it lowers TTFT and doubles the
        TBT tail in the simulator, and lowered the burst throughput of one 2-core 1P+1D machine
        (docs/architecture.md). Off, decode instances prefill only under ``disagg_threshold``, with
        no prefill instance live, or when none has room.
    slo_ttft_s / slo_tbt_s: early rejection. A request whose best placement predicts a TTFT or TBT
        above its SLO is rejected; None means no SLO.
    """

    balancing_threshold: float = 1.0
    disagg_threshold: int = 0
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None
    prefill_stealing: bool = False

    def __post_init__(self) -> None:
        t = self.balancing_threshold
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 1.0:
            raise ValueError(
                f"balancing_threshold must be a finite number >= 1.0 (a ratio of prefix lengths), got {t!r}; "
                "use 1.0 to let the fetch-or-recompute cost test decide alone"
            )
        d = self.disagg_threshold
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(
                f"disagg_threshold must be an integer number of tokens >= 0 (0 = off), got {d!r}"
            )
        if not isinstance(self.prefill_stealing, bool):
            raise ValueError(f"prefill_stealing must be True or False, got {self.prefill_stealing!r}")
        for name in ("slo_ttft_s", "slo_tbt_s"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number of seconds or None (no SLO), got {v!r}")
