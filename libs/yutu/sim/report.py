"""Writing a run out: ``summary.json``, ``requests.jsonl``, ``timeline.json`` and PNG plots.

The only module of ``yutu.sim`` that writes files. matplotlib (the ``load`` extra) is imported only
when plots are asked for; without it ``write_plots`` raises a RuntimeError saying how to get it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from yutu.sim.simulator import Simulation


def write_run(sim: Simulation, summary: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    """Write the run's files into ``out`` (created); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "summary.json", out / "requests.jsonl", out / "timeline.json"]
    paths[0].write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    with paths[1].open("w") as f:
        for index in sorted(sim.records):
            f.write(json.dumps(sim.records[index].as_dict(), sort_keys=True) + "\n")
    timeline = dataclasses.asdict(sim.timeline)
    timeline["replicas"] = {str(k): v for k, v in timeline["replicas"].items()}
    paths[2].write_text(json.dumps(timeline, sort_keys=True) + "\n")
    if plots:
        paths += write_plots(sim, out)
    return paths


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install -e '.[load]' (or pass --no-plots)") from None
    return plt


def write_plots(sim: Simulation, out: Path) -> list[Path]:
    """``load.png`` (prefill queue and decode batch over time), ``latency.png`` (TTFT and TBT CDFs),
    ``replicas.png`` (prefill caches holding the hottest blocks over time)."""
    plt = _pyplot()
    tl = sim.timeline
    paths = [out / "load.png", out / "latency.png", out / "replicas.png"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    top.plot(tl.t, [q / 1000 for q in tl.prefill_queued_tokens], lw=0.8)
    top.set_ylabel("prefill queue (k tokens)")
    bottom.plot(tl.t, tl.decode_running, lw=0.8, label="running")
    bottom.plot(tl.t, tl.decode_waiting, lw=0.8, label="waiting")
    bottom.set_ylabel("decode sequences")
    bottom.set_xlabel("time (s)")
    bottom.legend(loc="upper right")
    top.set_title(_title(sim))
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    done = [r for r in sim.records.values() if r.completed and r.rejected is None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, values, label in (
        (left, sorted(r.ttft_s or 0.0 for r in done), "TTFT (s)"),
        (right, sorted((r.tbt_s or 0.0) * 1000 for r in done), "TBT, worst 10% gaps (ms)"),
    ):
        n = max(1, len(values))
        ax.plot(values, [(i + 1) / n for i in range(len(values))], lw=1)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(_title(sim), fontsize=9)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 3.5))
    for rank, counts in sorted(tl.replicas.items()):
        if counts:
            ax.plot(tl.replica_t, counts, lw=1, label=f"rank {rank}")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("prefill caches holding it")
    ax.legend(loc="lower right")
    ax.set_title(_title(sim), fontsize=9)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths


def _title(sim: Simulation) -> str:
    c = sim.config
    return f"{c.policy}, {c.prefill}P{c.decode}D, rejection {c.rejection}, profile {c.profile.name}"
