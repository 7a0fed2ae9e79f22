"""``yutu simulate``: replay a Mooncake-format trace through a simulated cluster.

    yutu simulate --trace conversation_trace.jsonl --prefill 8 --decode 8 --policy kvcentric \\
        --slo-ttft-ms 30000 --slo-tbt-ms 100 --out runs/conv

prints the headline numbers and, with ``--out DIR``, writes ``DIR/summary.json`` (see
:mod:`yutu.sim.summary`), ``requests.jsonl`` (one record per request), ``timeline.json`` and plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import TextIO

from yutu.config import option
from yutu.evict import POLICIES as EVICTION_POLICIES
from yutu.sched import POLICIES
from yutu.sim.config import Rejection, SimConfig
from yutu.sim.profile import PAPER_PROFILE, Profile, load_profile
from yutu.sim.simulator import Simulation
from yutu.sim.summary import summarise
from yutu.sim.trace import TraceError, load_trace

HEADLINE = ("requests", "rejected", "ttft_mean_s", "ttft_p99_s", "tbt_p99_s", "goodput_rps",
            "slo_attainment", "cache_hit_ratio")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = partial(option, parser, scope="simulate")  # every option also from YUTU_SIMULATE_<OPTION>
    a(
        "--trace",
        default=None,
        help="Mooncake-format JSONL trace (timestamp ms, input/output_length, hash_ids); required",
    )
    a("--prefill", type=int, default=8, help="prefill instances (0: decode instances prefill themselves)")
    a("--decode", type=int, default=8, help="decode instances")
    a("--policy", default="kvcentric", choices=sorted(POLICIES), help="placement policy (yutu.sched)")
    a("--time-scale", type=float, default=1.0, help="replay k times faster than the trace's timestamps")
    a("--limit", type=int, default=None, help="replay only the first N requests")
    a("--slo-ttft-ms", type=float, default=None, help="TTFT SLO: judges goodput; early rejection uses it")
    a("--slo-tbt-ms", type=float, default=None, help="TBT SLO (mean of the worst 10%% token gaps)")
    a("--rejection", default=str(Rejection.PREDICTED), choices=[str(r) for r in Rejection],
      help="overload handling: none, after_prefill (decode refuses), early (load now), predicted (forecast)")  # fmt: skip
    a("--balancing-threshold", type=float, default=1.0, help="the policies' kvcache_balancing_threshold")
    a("--disagg-threshold", type=int, default=0, help="uncached tokens a decode instance prefills itself")
    a("--prefill-stealing", type=bool, default=False,
      help="decode instances take prefills off long prefill queues when that pays (yutu.sched.placer)")  # fmt: skip
    a(
        "--store-capacity-blocks",
        type=int,
        default=None,
        help="blocks the shared store holds (none: unlimited; 0: no store)",
    )
    a(
        "--cache-blocks",
        type=int,
        default=None,
        help="blocks of each prefill instance's cache (none: the profile's)",
    )
    a(
        "--eviction-policy",
        default="lru",
        choices=list(EVICTION_POLICIES),
        help="for the caches and the store",
    )
    a("--profile", default=PAPER_PROFILE, help=f"{PAPER_PROFILE} or a profile JSON (yutu calibrate)")
    a("--network-gbps", type=float, default=None, help="override the profile's network bandwidth (Gbit/s)")
    a("--learn-costs", type=bool, default=False,
      help="the policy starts from the conductor's priors and learns from the simulated measurements")  # fmt: skip
    a("--seed", type=int, default=0, help="seed of the service-time jitter")
    a("--jitter", type=float, default=0.0, help="sigma of a lognormal factor on every service time (0: none)")
    a("--out", default=None, help="write summary.json, requests.jsonl, timeline.json and plots here")
    a("--plots", type=bool, default=True, help="with --out: the PNG plots (--no-plots: no matplotlib needed)")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        prefill=args.prefill,
        decode=args.decode,
        policy=args.policy,
        profile=_profile(args),
        balancing_threshold=args.balancing_threshold,
        disagg_threshold=args.disagg_threshold,
        prefill_stealing=args.prefill_stealing,
        slo_ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000,
        slo_tbt_s=None if args.slo_tbt_ms is None else args.slo_tbt_ms / 1000,
        rejection=Rejection(args.rejection),
        store_capacity_blocks=args.store_capacity_blocks,
        cache_blocks=args.cache_blocks,
        eviction_policy=args.eviction_policy,
        seed=args.seed,
        jitter=args.jitter,
        learn_costs=args.learn_costs,
    )


def _profile(args: argparse.Namespace) -> Profile:
    profile = load_profile(args.profile)
    if args.network_gbps is None:
        return profile
    if not args.network_gbps > 0:
        raise ValueError(f"--network-gbps must be > 0, got {args.network_gbps}")
    return dataclasses.replace(profile, network_bps=args.network_gbps * 1e9 / 8)


class ProgressBar:
    """A one-line bar on ``stream``, drawn only when it is a terminal."""

    def __init__(self, stream: TextIO, label: str) -> None:
        self.stream, self.label = stream, label
        self.enabled = stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * done // max(1, total)
        end = "\n" if done >= total else ""
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}{end}")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    if args.trace is None:
        print("yutu simulate: --trace FILE is required (a Mooncake-format JSONL trace)", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        requests = load_trace(
            args.trace, time_scale=args.time_scale, block_size=config.profile.block_size, limit=args.limit
        )
    except (OSError, ValueError) as exc:
        kind = "trace" if isinstance(exc, TraceError | OSError) else "options"
        print(f"yutu simulate: bad {kind}: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    sim = Simulation(config, requests)
    sim.run(ProgressBar(sys.stderr, "simulating"))
    summary = summarise(sim)
    wall = time.perf_counter() - started
    print(json.dumps({k: summary[k] for k in HEADLINE}))
    print(f"simulated {len(requests)} requests, {sim.events} events in {wall:.1f} s", file=sys.stderr)
    if args.out is not None:
        from yutu.sim.report import write_run

        try:
            paths = write_run(sim, summary, Path(args.out), plots=args.plots)
        except RuntimeError as exc:
            print(f"yutu simulate: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0
