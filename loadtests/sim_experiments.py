"""The simulator experiments of docs/simulation.md: runs them and prints their tables (Markdown).

    .venv/bin/python loadtests/sim_experiments.py all              # every table, ~4 min on one core
    .venv/bin/python loadtests/sim_experiments.py capacity         # or one: capacity, ablation,
                                                                   # overload, pd, ours, stealing
    ... --plots docs/simulation                                    # also the overload load plot

Every run is the paper profile (paper-llama3-70b-a800) through ``yutu.sim`` in this process; the
traces are the Mooncake FAST'25 ones (``FAST25-release/traces/`` of github.com/kvcache-ai/Mooncake;
``--traces DIR``, by default a ``shared/traces`` folder beside the repository's).
Single-process Python: keep one running at a time on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from yutu.sim.config import Rejection, SimConfig
from yutu.sim.hitratio import hit_ratio
from yutu.sim.profile import paper_profile
from yutu.sim.simulator import Simulation
from yutu.sim.summary import summarise
from yutu.sim.trace import TraceRequest, load_trace

LOCAL = paper_profile().cache_blocks  # 5,859 blocks = 3M tokens: one node's DRAM cache (the paper's)
TRACES = ("conversation", "synthetic")


def trace(dir_: Path, name: str, scale: float = 1.0) -> list[TraceRequest]:
    return load_trace(dir_ / f"{name}_trace.jsonl", time_scale=scale)


def simulate(requests: list[TraceRequest], **config: object) -> tuple[Simulation, dict[str, object]]:
    started = time.perf_counter()
    sim = Simulation(SimConfig(**config), requests)  # type: ignore[arg-type]
    sim.run()
    summary = summarise(sim)
    print(f"  [{time.perf_counter() - started:.1f} s] {config}", file=sys.stderr, flush=True)
    return sim, summary


def capacity(dir_: Path, plots: Path | None) -> list[str]:
    caps: list[int | None] = [1000, 3000, LOCAL, 10_000, 30_000, None]
    out = [
        "| trace | policy | "
        + " | ".join("unlimited" if c is None else f"{c:,}" for c in caps)
        + f" | at {LOCAL:,} (3M tokens) / max |",
        "|---|---|" + "---|" * (len(caps) + 1),
    ]
    for name in TRACES:
        reqs = trace(dir_, name)
        for policy in ("lru", "lfu", "adaptive"):
            ratios = [hit_ratio(reqs, policy, c) for c in caps]
            at3m = ratios[caps.index(LOCAL)] / ratios[-1]
            out.append(
                f"| {name} | {policy} | " + " | ".join(f"{r:.3f}" for r in ratios) + f" | {at3m:.0%} |"
            )
    return out


def ablation(dir_: Path, plots: Path | None) -> list[str]:
    reqs = trace(dir_, "conversation", 2.5)
    pooled = 8 * LOCAL
    out = [
        "| policy | store | TTFT mean (s) | TTFT p99 (s) | cache hit | local hit | prefill compute (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    runs = [("round_robin", 0), ("least_loaded", 0), ("cache_aware", 0), ("kvcentric", pooled),
            ("round_robin", pooled), ("least_loaded", pooled), ("cache_aware", pooled),
            ("kvcentric_affinity", pooled)]  # fmt: skip
    for policy, store in runs:
        _, s = simulate(reqs, prefill=8, decode=8, policy=policy, store_capacity_blocks=store)
        out.append(
            f"| {policy} | {'none' if store == 0 else f'{store:,} blocks'} | {s['ttft_mean_s']:.2f} | "
            f"{s['ttft_p99_s']:.1f} | {s['cache_hit_ratio']:.3f} | {s['local_hit_ratio']:.3f} | "
            f"{s['prefill_compute_s']:,.0f} |"
        )
    return out


def overload(dir_: Path, plots: Path | None) -> list[str]:
    reqs = trace(dir_, "conversation", 2.0)
    out = [
        "| rejection | rejected | of which after prefill | wasted prefill (s) | good | goodput (req/s) "
        "| TTFT mean (s) | TBT p99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    sims = {}
    for mode in (Rejection.AFTER_PREFILL, Rejection.EARLY, Rejection.PREDICTED):
        sim, s = simulate(reqs, prefill=4, decode=1, policy="kvcentric", store_capacity_blocks=4 * LOCAL,
                          slo_ttft_s=30.0, slo_tbt_s=0.04, rejection=mode)  # fmt: skip
        sims[str(mode)] = sim
        causes = s["rejected_by_cause"]
        assert isinstance(causes, dict)
        out.append(
            f"| {mode} | {s['rejected']:,} | {causes.get('decode_tbt', 0):,} | {s['wasted_prefill_s']:,.0f} | "
            f"{s['good']:,} | {s['goodput_rps']:.3f} | {s['ttft_mean_s']:.2f} | {float(s['tbt_p99_s']) * 1000:.1f} |"  # type: ignore[arg-type]
        )
    if plots is not None:
        out.append("")
        out.append(f"plot: {oscillation_plot(sims, plots / 'overload.png')}")
    return out


def oscillation_plot(sims: dict[str, Simulation], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(sims), 1, figsize=(9, 2.2 * len(sims)), sharex=True)
    for ax, (mode, sim) in zip(axes, sims.items(), strict=True):
        tl = sim.timeline
        ax.plot(tl.t, tl.decode_running, lw=0.6, color="tab:blue", label="decode batch (sequences)")
        ax.set_ylabel(mode)
        twin = ax.twinx()
        twin.plot(tl.t, [q / 1e6 for q in tl.prefill_queued_tokens], lw=0.6, color="tab:orange",
                  label="prefill queue (M tokens)")  # fmt: skip
        if ax is axes[0]:
            ax.legend(loc="upper left", fontsize=7)
            twin.legend(loc="upper right", fontsize=7)
    axes[-1].set_xlabel("time (s), conversation trace at 2x, 4 prefill + 1 decode")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def pd(dir_: Path, plots: Path | None) -> list[str]:
    reqs = trace(dir_, "synthetic", 6.0)
    out = ["| P:D | SLO attainment | goodput (req/s) | TTFT mean (s) | TBT mean (ms) | rejected |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for p in (4, 6, 8, 10, 12, 14):
        _, s = simulate(reqs, prefill=p, decode=16 - p, policy="kvcentric", store_capacity_blocks=p * LOCAL,
                        slo_ttft_s=10.0, slo_tbt_s=0.1)  # fmt: skip
        out.append(
            f"| {p}:{16 - p} | {s['slo_attainment']:.3f} | {s['goodput_rps']:.2f} | {s['ttft_mean_s']:.2f} | "
            f"{float(s['tbt_mean_s']) * 1000:.1f} | {s['rejected']:,} |"  # type: ignore[arg-type]
        )
    return out


def ours(dir_: Path, plots: Path | None) -> list[str]:
    out = ["| trace | policy | good | goodput (req/s) | rejected | TTFT mean (s) | cache hit | local hit |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in TRACES:
        reqs = trace(dir_, name, 4.0)
        for policy in ("kvcentric", "cache_aware", "kvcentric_affinity"):
            _, s = simulate(reqs, prefill=4, decode=2, policy=policy, store_capacity_blocks=4 * LOCAL,
                            slo_ttft_s=10.0, slo_tbt_s=0.04)  # fmt: skip
            out.append(
                f"| {name} | {policy} | {s['good']:,} | {s['goodput_rps']:.3f} | {s['rejected']:,} | "
                f"{s['ttft_mean_s']:.2f} | {s['cache_hit_ratio']:.3f} | {s['local_hit_ratio']:.3f} |"
            )
    return out


def stealing(dir_: Path, plots: Path | None) -> list[str]:
    """Prefill stealing (beyond the paper) on the ablation's and the overload's set-ups, kvcentric."""
    out = ["| set-up | stealing | local prefills | good | rejected | TTFT mean (s) | TTFT p99 (s) | TBT p99 (ms) |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    setups = {
        "8P+8D, 2.5x, no SLO": (trace(dir_, "conversation", 2.5),
                                dict(prefill=8, decode=8, store_capacity_blocks=8 * LOCAL)),
        "4P+1D, 2x, SLO 30 s / 40 ms": (trace(dir_, "conversation", 2.0),
                                        dict(prefill=4, decode=1, store_capacity_blocks=4 * LOCAL,
                                             slo_ttft_s=30.0, slo_tbt_s=0.04)),
    }  # fmt: skip
    for name, (reqs, config) in setups.items():
        for on in (False, True):
            _, s = simulate(reqs, policy="kvcentric", prefill_stealing=on, **config)
            out.append(
                f"| {name} | {'on' if on else 'off'} | {s['local_prefills']:,} | {s['good']:,} | {s['rejected']:,} | "
                f"{s['ttft_mean_s']:.2f} | {s['ttft_p99_s']:.1f} | {float(s['tbt_p99_s']) * 1000:.1f} |"  # type: ignore[arg-type]
            )
    return out


EXPERIMENTS: dict[str, Callable[[Path, Path | None], list[str]]] = {
    "capacity": capacity, "ablation": ablation, "overload": overload, "pd": pd, "ours": ours,
    "stealing": stealing,
}  # fmt: skip


def main() -> int:
    default = Path(__file__).resolve().parents[2] / "shared" / "traces"
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    parser.add_argument("--traces", type=Path, default=default, help="directory of the Mooncake traces")
    parser.add_argument("--plots", type=Path, default=None, help="write the overload plot here")
    args = parser.parse_args()
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    for name in names:
        print(f"\n## {name}\n", flush=True)
        print("\n".join(EXPERIMENTS[name](args.traces, args.plots)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
