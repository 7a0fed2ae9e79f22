"""CPU time per generated token in each process of the serving path, engine core in a process
against on a thread (``--engine-core process|thread``), same stack, same requests, same run.

    .venv/bin/python loadtests/serving_cpu.py [--rounds 2] [--placements process,thread] [--repeat 1]
        [--out serving_cpu.json]

CPU time (user + system, from /proc) is what a process costs the machine whatever else runs on
it, so unlike wall-clock TPOT it holds on a shared, noisy 2-core machine. For each core placement
a mixed stack (``yutu up --workers 1 --store-nodes 0``) serves, through the gateway's streaming
API: ``batch1`` -- 8 prompts of 256 fresh tokens one after another, 64 tokens out each -- and
``batch16`` -- 16 such requests at once, 64 out. Printed per scenario: CPU ms per output token of
the gateway, of the worker process and of the engine process (on a thread, the engine's CPU is
the worker's), their sum, and the client-timed TPOT p50. Rounds alternate the two placements.

``--placements process`` measures the default placement alone, e.g. once on each of two checkouts
to compare a change to the serving path; ``--repeat N`` sends each scenario's requests N times
(fresh prompts) and sums the CPU over all of them: /proc counts CPU in ticks of 10 ms, so one
batch16 scenario (1,024 tokens, ~80 ms of the gateway's CPU) reads it to within ~12%, eight
repeats to within ~2%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from disagg_stack import Reply, Stack, StackSpec, private_dir, shm_directory  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PROMPT_TOKENS, OUTPUT_TOKENS = 256, 64
PLACEMENTS = ("process", "thread")
FIGURES = (*(f"{p}_cpu_ms_per_token" for p in ("gateway", "worker", "engine", "total")), "tpot_p50_ms")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime (fields 14, 15)


def pids(stack: Stack) -> dict[str, int]:
    (gateway,) = stack.records("gateway").values()
    ((worker_id, worker),) = stack.records("worker").items()
    engine_pid = stack.admin_json("worker", worker_id, "/info")["engine_pid"]
    out = {"gateway": int(gateway["pid"]), "worker": int(worker["pid"])}
    if engine_pid is not None:
        out["engine"] = int(engine_pid)
    return out


def measure(stack: Stack, batches: list[list[list[int]]], concurrency: int) -> dict[str, float]:
    """Each batch's prompts sent ``concurrency`` at a time, batch after batch; CPU over all."""
    procs = pids(stack)
    before = {name: cpu_s(pid) for name, pid in procs.items()}
    replies: list[Reply] = []
    with ThreadPoolExecutor(concurrency) as pool:
        for prompts in batches:
            replies += pool.map(lambda ids: stack.complete(ids, OUTPUT_TOKENS), prompts)
    after = {name: cpu_s(pid) for name, pid in procs.items()}
    tokens = sum(r.completion_tokens for r in replies)
    out = {f"{name}_cpu_ms_per_token": 1e3 * (after[name] - before[name]) / tokens for name in procs}
    out.setdefault("engine_cpu_ms_per_token", 0.0)
    out["total_cpu_ms_per_token"] = sum(v for k, v in out.items() if k.endswith("_cpu_ms_per_token"))
    tpots = [(r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1) for r in replies]
    out["tpot_p50_ms"] = 1e3 * statistics.median(tpots)
    return out


def run_core(core: str, work: Path, rng: random.Random, repeat: int) -> dict[str, dict[str, float]]:
    spec = StackSpec(f"cpu-{core}", workers=1, store_nodes=0, engine_core=core)
    with shm_directory() as shm, Stack(spec, work / core, shm) as stack:

        def fresh(n: int) -> list[list[list[int]]]:
            return [
                [[rng.randrange(stack.vocab_size) for _ in range(PROMPT_TOKENS)] for _ in range(n)]
                for _ in range(repeat)
            ]

        stack.complete(fresh(1)[0][0], 4)  # warm-up
        results = {"batch1": measure(stack, fresh(8), 1), "batch16": measure(stack, fresh(16), 16)}
        if stack.leftovers:
            raise RuntimeError(f"region files left after the stack stopped: {stack.leftovers}")
    return results


def report(rounds: list[dict[str, Any]], placements: tuple[str, ...]) -> str:
    both = placements == PLACEMENTS
    lines = ["scenario figure                      " + "".join(f"{c:>9}" for c in placements)
             + ("  process/thread" if both else "")]  # fmt: skip
    for scenario in ("batch1", "batch16"):
        for key in FIGURES:
            values = [statistics.median(r[c][scenario][key] for r in rounds) for c in placements]
            name = "tpot_p50_ms (wall)" if key == "tpot_p50_ms" else key
            ratio = f"  {values[0] / values[1]:.2f}x" if both and values[1] else ("  -" if both else "")
            lines.append(f"{scenario:8} {name:28}" + "".join(f"{v:9.3f}" for v in values) + ratio)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the placements, alternating")
    parser.add_argument(
        "--placements",
        default="process,thread",
        help="engine-core placements to measure, comma-separated: process, thread (default both)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="send each scenario's requests this many times (fresh prompts); CPU summed over all",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the measurements as JSON here")
    args = parser.parse_args(argv)
    names = set(args.placements.split(","))
    if not names <= set(PLACEMENTS):
        parser.error(f"--placements takes process and/or thread, got {args.placements!r}")
    if args.rounds < 1 or args.repeat < 1:
        parser.error("--rounds and --repeat must be at least 1")
    placements = tuple(c for c in PLACEMENTS if c in names)
    rng = random.Random(0)
    rounds: list[dict[str, Any]] = []
    with private_dir(Path("/tmp"), "yutu-serving-cpu-") as work:
        for i in range(args.rounds):
            order = placements if i % 2 == 0 else placements[::-1]
            rounds.append({core: run_core(core, work / f"r{i}", rng, args.repeat) for core in order})
            print(f"round {i + 1}/{args.rounds} done at {time.strftime('%H:%M:%S')}", flush=True)
    print(report(rounds, placements))
    if args.out is not None:
        args.out.write_text(json.dumps(rounds, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
