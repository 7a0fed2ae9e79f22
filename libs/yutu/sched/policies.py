"""The placement policies and the registry that builds them by name.

Each policy is a :class:`~yutu.sched.placer.Placer`: the shared steps (capacity, prefix plan with
fetch-or-recompute, conditional disaggregation, early rejection) around its two choices.

| name          | prefill instance                                  | decode instance                        |
|---------------|---------------------------------------------------|----------------------------------------|
| round_robin   | in turn                                           | in turn                                |
| least_loaded  | least queued work (predicted seconds)             | fewest sequences now (running+incoming)|
| cache_aware   | longest local prefix; least queued work on a tie  | as least_loaded                        |
| kvcentric     | least predicted TTFT (Mooncake Algorithm 1)       | least predicted TBT at the prefill end |
| kvcentric_affinity | longest local prefix among those within 30% of the least predicted TTFT | as kvcentric |

Remaining ties go to the lowest instance id. "In turn" walks the instances able to take the request,
sorted by id, with one counter per role that advances on every choice: state lives in the policy
object, so one object serves one stream of placements (replaying the same calls replays the same
answers). Not thread-safe: call ``place`` from one thread (the conductor's event loop).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from yutu.sched.costs import CostModels
from yutu.sched.estimate import Estimate
from yutu.sched.options import PolicyOptions
from yutu.sched.placer import DecodeCandidate, Placer, Policy


def _decode_load_now(c: DecodeCandidate) -> tuple[int, int, str]:
    d = c.view
    return (
        d.batch_size + len(d.incoming),
        d.kv_tokens + sum(i.prompt_len for i in d.incoming),
        d.instance_id,
    )


class RoundRobin(Placer):
    """Prefill and decode instances in turn."""

    name = "round_robin"

    def __init__(self, options: PolicyOptions | None = None, costs: CostModels | None = None) -> None:
        super().__init__(options, costs)
        self._next_prefill = 0
        self._next_decode = 0

    def choose_prefill(self, candidates: Sequence[Estimate]) -> Estimate:
        chosen = candidates[self._next_prefill % len(candidates)]
        self._next_prefill += 1
        return chosen

    def choose_decode(self, candidates: Sequence[DecodeCandidate]) -> DecodeCandidate:
        chosen = candidates[self._next_decode % len(candidates)]
        self._next_decode += 1
        return chosen


class LeastLoaded(Placer):
    """The prefill instance with the least queued work; the decode instance with the fewest sequences."""

    name = "least_loaded"

    def choose_prefill(self, candidates: Sequence[Estimate]) -> Estimate:
        return min(candidates, key=lambda e: (e.queue_s, e.instance_id))

    def choose_decode(self, candidates: Sequence[DecodeCandidate]) -> DecodeCandidate:
        return min(candidates, key=_decode_load_now)


class CacheAware(LeastLoaded):
    """The prefill instance with the longest local prefix, least queued work breaking ties."""

    name = "cache_aware"

    def choose_prefill(self, candidates: Sequence[Estimate]) -> Estimate:
        return min(candidates, key=lambda e: (-e.plan.local_blocks, e.queue_s, e.instance_id))


class KVCentric(Placer):
    """Mooncake's Algorithm 1: least predicted TTFT (queue + transfer + prefill, the prefix plan
    counted), then the decode instance with the least TBT predicted at the prefill's end.

    Ties on TTFT go to the shorter queue, then the lowest id; ties on TBT to the lowest id.
    """

    name = "kvcentric"

    def choose_prefill(self, candidates: Sequence[Estimate]) -> Estimate:
        return min(candidates, key=lambda e: (e.ttft_s, e.queue_s, e.instance_id))

    def choose_decode(self, candidates: Sequence[DecodeCandidate]) -> DecodeCandidate:
        return min(candidates, key=lambda c: (c.tbt_s, c.instance_id))


class KVCentricAffinity(KVCentric):
    """kvcentric with cache affinity: among the prefill instances whose predicted TTFT is within
    ``AFFINITY`` (relative) of the least, the one with the longest local prefix (then the least TTFT,
    the lowest id). Trading a little predicted TTFT for locality keeps a conversation where its KV
    already is: fewer store reads, and the store's capacity is not spent re-fetching what a local
    cache could have kept. It won goodput over kvcentric on both Mooncake traces in the simulator
    (docs/simulation.md).
    """

    name = "kvcentric_affinity"
    AFFINITY = 0.3

    def choose_prefill(self, candidates: Sequence[Estimate]) -> Estimate:
        best = min(e.ttft_s for e in candidates)
        near = [e for e in candidates if e.ttft_s <= best * (1 + self.AFFINITY)]
        return min(near, key=lambda e: (-e.plan.local_blocks, e.ttft_s, e.queue_s, e.instance_id))


POLICIES: dict[str, type[Placer]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, CacheAware, KVCentric, KVCentricAffinity)
}


def policy_by_name(name: str, *, costs: CostModels | None = None, **options: object) -> Placer:
    """Build the policy called ``name`` with :class:`PolicyOptions` fields as keyword ``options``.

    ``costs``: the cost models it consults (the caller keeps feeding their ``observe``); fresh priors
    when None. Raises ValueError for an unknown name or option, or an invalid option value.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown placement policy {name!r}; choose one of {', '.join(POLICIES)}")
    fields = {f.name for f in dataclasses.fields(PolicyOptions)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"unknown policy option(s) {unknown}; valid options are {sorted(fields)}")
    return cls(PolicyOptions(**options), costs)  # type: ignore[arg-type]


def _conforms(p: Placer) -> Policy:  # mypy checks that every Placer is a Policy
    return p
