"""Replays the block keys of a Mooncake trace through each eviction policy and prints hit ratios.

Each hash id of a trace request is one cached block (unit size); a request reads its blocks in
order. Per block: a resident key is a hit (``access``); a missing one is a miss, and the cache
evicts what ``victims`` names until the block fits, then ``insert``s it. Two ways to count:

- ``block`` (default): every resident block is a hit, wherever it sits in the prompt;
- ``prefix`` (``--prefix``): only the blocks before a request's first miss are hits, as a prefix
  cache reuses them; the blocks after it are recomputed and written again (an access when still
  resident, an insert when not).

Capacities are fractions of the trace's distinct blocks (``--fractions``) or block counts
(``--capacities``). The unlimited cache's ratio is the ceiling every row is bounded by.

    .venv/bin/python loadtests/eviction_replay.py TRACE.jsonl [--limit N] [--prefix] [--json OUT]

``replay`` is importable (a cluster simulator builds on it): pure, no clock, deterministic.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_trace import read_trace  # noqa: E402
from yutu.evict import POLICIES, make_policy  # noqa: E402


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    capacity: int  # blocks
    lookups: int  # blocks read
    hits: int
    evictions: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def replay(
    policy_name: str, capacity: int, requests: Sequence[Sequence[int]], prefix: bool = False
) -> ReplayResult:
    """The hits of a ``capacity``-block cache under ``policy_name`` reading ``requests`` (each a
    list of block hash ids) in order; ``prefix``: count hits only up to each request's first miss."""
    policy = make_policy(policy_name, capacity)
    lookups = hits = evictions = 0
    for blocks in requests:
        reusing = True
        for block in blocks:
            key = str(block)
            lookups += 1
            if key in policy:
                policy.access(key)
                if reusing or not prefix:
                    hits += 1
                continue
            reusing = False
            for victim in policy.victims(policy.used + 1 - capacity):
                policy.remove(victim)
                evictions += 1
            policy.insert(key)
    return ReplayResult(policy_name, capacity, lookups, hits, evictions)


def unlimited_hits(requests: Sequence[Sequence[int]], prefix: bool = False) -> tuple[int, int]:
    """(hits, lookups) of a cache that never evicts."""
    seen: set[int] = set()
    hits = lookups = 0
    for blocks in requests:
        reusing = True
        for block in blocks:
            lookups += 1
            if block in seen:
                hits += reusing or not prefix
            else:
                reusing = False
                seen.add(block)
    return hits, lookups


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path, help="a Mooncake FAST'25 trace (.jsonl)")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {POLICIES}")
    ap.add_argument(
        "--fractions",
        default="0.02,0.05,0.1,0.25,0.5",
        help="capacities as fractions of the distinct blocks (default %(default)s)",
    )
    ap.add_argument("--capacities", default=None, help="capacities in blocks (instead of --fractions)")
    ap.add_argument("--prefix", action="store_true", help="count hits only before each request's first miss")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in policies:
        if name not in POLICIES:
            raise SystemExit(f"unknown policy {name!r}: choose from {', '.join(POLICIES)}")
    requests = [r.hash_ids for r in read_trace(args.trace, limit=args.limit)]
    distinct = len({b for blocks in requests for b in blocks})
    if args.capacities:
        capacities = [int(c) for c in args.capacities.split(",")]
    else:
        capacities = [max(1, round(float(f) * distinct)) for f in args.fractions.split(",")]
    ceiling, lookups = unlimited_hits(requests, args.prefix)
    mode = "prefix" if args.prefix else "block"
    print(
        f"{args.trace.name}: {len(requests)} requests, {lookups} block reads, {distinct} distinct blocks; "
        f"{mode} hits, unlimited cache {ceiling / lookups:.2%}"
    )
    print(f"{'capacity':>10} {'% distinct':>10} " + " ".join(f"{p:>9}" for p in policies))
    rows: list[dict[str, object]] = []
    for capacity in capacities:
        cells = []
        for name in policies:
            started = time.perf_counter()
            result = replay(name, capacity, requests, args.prefix)
            rows.append(
                asdict(result)
                | {
                    "hit_ratio": result.hit_ratio,
                    "mode": mode,
                    "seconds": round(time.perf_counter() - started, 3),
                }
            )
            cells.append(f"{result.hit_ratio:>9.2%}")
        print(f"{capacity:>10} {capacity / distinct:>10.1%} " + " ".join(cells))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "trace": str(args.trace),
                    "mode": mode,
                    "distinct_blocks": distinct,
                    "unlimited_hit_ratio": ceiling / lookups,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
