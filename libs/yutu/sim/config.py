"""One simulation's settings, validated once (``SimConfig``), and the overload-handling modes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from yutu.evict import POLICIES as EVICTION_POLICIES
from yutu.sched import POLICIES, PolicyOptions
from yutu.sim.profile import Profile, paper_profile


class Rejection(StrEnum):
    """How overload is turned away (the SLOs judge goodput in every mode).

    - ``none``: nothing is rejected; the policy runs without SLOs and requests queue.
    - ``after_prefill``: the policy rejects early on its TTFT prediction and on a decode batch
      forecast to be full, but it is shown every decode KV block as free and has no TBT SLO; a
      decode instance refuses a request whose KV arrives when it has no batch slot or KV blocks for
      it now, or when its next step would exceed the TBT SLO -- after the prefill was spent on it
      (the paper's first baseline).
    - ``early``: the policy's early rejection on the load of this instant (no forecast of who will
      have left by the prefill's end: the paper's "early rejection").
    - ``predicted``: the policy's early rejection on the decode load forecast at the prefill's end
      (the conductor's own; the paper's "prediction-based early rejection").
    """

    NONE = "none"
    AFTER_PREFILL = "after_prefill"
    EARLY = "early"
    PREDICTED = "predicted"


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 8
    decode: int = 8
    policy: str = "kvcentric"
    profile: Profile = field(default_factory=paper_profile)
    balancing_threshold: float = 1.0
    disagg_threshold: int = 0
    prefill_stealing: bool = False
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None
    rejection: Rejection = Rejection.PREDICTED
    store_capacity_blocks: int | None = None  # None: unlimited; 0: no store (local caches only)
    cache_blocks: int | None = None  # per prefill instance; None: the profile's
    eviction_policy: str = "lru"
    seed: int = 0
    jitter: float = 0.0  # sigma of a lognormal factor on every service time (0: exact profile)
    learn_costs: bool = False  # the policy starts from the conductor's priors and learns (see simulator)
    sample_s: float = 1.0  # load timeline resolution
    replica_sample_s: float = 30.0  # hot-block replica counts (the paper samples every 30 s)

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"need --prefill >= 0 and --decode >= 1, got {self.prefill} and {self.decode}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction policy {self.eviction_policy!r}; choose one of {', '.join(EVICTION_POLICIES)}"
            )
        if self.store_capacity_blocks is not None and self.store_capacity_blocks < 0:
            raise ValueError(
                f"store_capacity_blocks must be >= 0 (0: no store) or None (unlimited), got {self.store_capacity_blocks}"
            )
        if self.cache_blocks is not None and self.cache_blocks < 0:
            raise ValueError(
                f"cache_blocks must be >= 0 (0: no local cache) or None (the profile's), got {self.cache_blocks}"
            )
        if not (math.isfinite(self.jitter) and self.jitter >= 0):
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")
        if not (self.sample_s > 0 and self.replica_sample_s > 0):
            raise ValueError("sample_s and replica_sample_s must be > 0")
        self.policy_options()  # validates the thresholds and SLOs

    def policy_options(self) -> PolicyOptions:
        """The options the policy gets in this rejection mode (module docstring of Rejection)."""
        ttft = None if self.rejection is Rejection.NONE else self.slo_ttft_s
        tbt = self.slo_tbt_s if self.rejection in (Rejection.EARLY, Rejection.PREDICTED) else None
        return PolicyOptions(
            self.balancing_threshold, self.disagg_threshold, ttft, tbt, prefill_stealing=self.prefill_stealing
        )

    @property
    def local_cache_blocks(self) -> int:
        return self.profile.cache_blocks if self.cache_blocks is None else self.cache_blocks
