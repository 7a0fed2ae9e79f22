"""The disaggregation benchmark (issue #8): what prefill/decode disaggregation and the KV store buy.

    .venv/bin/python loadtests/bench_disagg.py [--only store-hit,handoff,trace,policies] [--out bench.json]

Each scenario starts the ``yutu up`` stacks it needs (the demo model, 4096 positions), measures,
and stops them; every number in a comparison comes from the same run. The disaggregated stacks run
with ``--no-prefill-stealing`` (``yutu up`` turns stealing on): every prefill on a prefill
instance, the path these scenarios measure. Scenarios:

1. ``store-hit``: ``--prefill 2 --decode 1 --policy round_robin --disagg-threshold 0`` (so a
   16-token remainder still goes to a prefill instance). TTFT of a cold prompt A against a prompt
   B sharing all but its last block, which lands on the other prefill instance and fetches A's
   blocks from the KV store (see ``disagg_probes``). Target: hit <= 0.5x cold at 2048 tokens.
2. ``handoff``: on the same stack, the gateway's ``yutu_gateway_handoff_seconds`` per request
   (prefill's first token -> decode's first delta) next to the transfer engine alone moving the
   same KV bytes between two processes.
3. ``trace``: the Mooncake conversation trace (a conversation-sampled slice, ``disagg_replays``)
   replayed open loop against ``--prefill 1 --decode 1 --torch-threads 1`` and ``--workers 1
   --torch-threads 2``. Target: TBT p99 (1P+1D) / (mixed) <= 0.5 with goodput not lower.
4. ``policies``: ``--prefill 2 --decode 2 --torch-threads 1`` under each conductor policy, same
   slice: mean / p99 TTFT and cached ratio, ordered, against the paper's order.
5. ``threshold``: ``--prefill 1 --decode 1 --torch-threads 1``, the conductor's threshold switched
   at run time: a small uncached remainder handed off against prefilled on the decode, with
   streams decoding there (``disagg_threshold``); the crossover is what ``--disagg-threshold``
   defaults to.
``sweep`` (not in the default set): the trace stacks at several time scales, to find saturation.

The load. The default slice (the first 900 s of the trace, 1 conversation in 8: 349 requests,
21% of prompt tokens reusable) at x12 is 4.7 requests/s for ~75 s. ``--only sweep`` on a 2-core
host (two sweeps): 1P+1D, whose one prefill thread is its bottleneck, follows the offered rate up
to x12 (TTFT p99 ~1.1 s) and falls behind from x16 (5.3-5.8 of 6.4 requests/s done, TTFT p99
2-4 s, goodput share down to 66-75%); the mixed worker (2 threads) follows up to x16 and falls
behind at x24. x12 is the highest scale of the sweep both stacks still follow: near saturation for
1P+1D, below it for the mixed worker. The default scenarios take ~10 minutes.

Isolation and cleanup (``disagg_stack``): each stack has its own Redis, free ports and logs in a
temp dir, region files in a private /dev/shm folder; every stack is stopped on every way out
(Ctrl-C and SIGTERM included). A system that breaks a promise (an error, a wrong header, fewer
cached tokens than due, a crash) is reported as a PROBLEM and the bench exits 1; missed targets
are reported as MISS (exit 0). ``--keep-logs`` keeps the temp dir (logs) for a look afterwards.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from disagg_probes import (  # noqa: E402
    ProbeConfig,
    format_handoff,
    format_store_hit,
    run_handoff,
    run_store_hit,
)
from disagg_replays import (  # noqa: E402
    TraceConfig,
    format_policies,
    format_sweep,
    format_trace,
    run_policies,
    run_sweep,
    run_trace,
    write_slice,
)  # fmt: skip
from disagg_stack import Stack, StackError, StackSpec, private_dir, shm_directory  # noqa: E402
from disagg_threshold import THRESHOLD_STACK, ThresholdConfig, format_threshold, run_threshold  # noqa: E402
from yutu.config import DEFAULT_DISAGG_THRESHOLD  # noqa: E402

SCENARIOS = ("store-hit", "handoff", "threshold", "trace", "policies", "sweep")
DEFAULT = ("store-hit", "handoff", "threshold", "trace", "policies")
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
WORK_PREFIX = "yutu-bench-disagg-"
PROBE_STACK = StackSpec("probes", prefill=2, decode=1, policy="round_robin", disagg_threshold=0,
                        prefill_stealing=False)  # fmt: skip


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(DEFAULT), help=f"scenarios, comma separated, of {', '.join(SCENARIOS)}"
                   f" (default: {','.join(DEFAULT)})")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with every service's log")
    g = p.add_argument_group("store-hit and handoff")
    g.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens, multiples of 16")
    g.add_argument("--reps", type=int, default=5, help="repetitions per length (fresh prompts each)")
    g.add_argument("--max-tokens", type=int, default=4, help="tokens per store-hit request")
    g.add_argument("--handoff-tokens", type=int, default=8, help="tokens per handoff request (>= 3)")
    g.add_argument("--transfer-repeat", type=int, default=15, help="timed pulls per size and shape")
    g = p.add_argument_group("threshold")
    g.add_argument("--threshold-remainders", default="16,32,64,128,256",
                   help="uncached remainders in tokens (multiples of 16)")  # fmt: skip
    g.add_argument("--threshold-reps", type=int, default=5, help="prompts per remainder and mode")
    g = p.add_argument_group("trace, policies and sweep")
    g.add_argument("--trace", type=Path, default=TRACE, help="Mooncake FAST'25 conversation trace (.jsonl, from"
                   " FAST25-release/traces/ of github.com/kvcache-ai/Mooncake)")  # fmt: skip
    g.add_argument("--trace-start", type=int, default=0, help="first trace line of the window")
    g.add_argument("--trace-window", type=float, default=900.0, help="trace seconds the slice is taken from")
    g.add_argument("--trace-sample", type=int, default=8, help="keep 1 conversation in this many (1: all)")
    g.add_argument("--block-tokens", type=int, default=32, help="wire tokens per 512-token trace block")
    g.add_argument("--output-scale", type=float, default=None, help="max_tokens per trace output token"
                   " (default: block-tokens/512)")  # fmt: skip
    g.add_argument(
        "--time-scale", type=float, default=12.0, help="replay this many times faster than recorded"
    )
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT SLO of goodput")
    g.add_argument("--slo-tbt-ms", type=float, default=100.0, help="TBT SLO of goodput")
    g.add_argument("--policies", default="round_robin,least_loaded,cache_aware,kvcentric")
    g.add_argument("--policy-rounds", type=int, default=1, help="runs of every policy, interleaved"
                   " (~6 minutes a round; one round's order is within the noise of a shared 2-core host)")  # fmt: skip
    g.add_argument("--policy-store-nodes", type=int, default=None, help="store nodes of the policies' stacks"
                   " (default: yutu up's; 0 runs them without the KV store, so reuse is local only)")  # fmt: skip
    g.add_argument("--sweep-scales", default="8,12,16,24", help="time scales of the sweep")
    g.add_argument("--sweep-duration", type=float, default=20.0, help="replay seconds of each sweep point")
    return p


def configs(args: argparse.Namespace) -> tuple[list[str], ProbeConfig, ThresholdConfig, TraceConfig]:
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SCENARIOS))
    if unknown or not only:
        raise SystemExit(
            f"bench_disagg: error: unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}"
        )
    lengths = tuple(int(x) for x in args.lengths.split(","))
    if any(n < 32 or n % 16 or n > 4096 - 16 for n in lengths) or args.reps < 1:
        raise SystemExit("bench_disagg: error: --lengths must be multiples of 16 in [32, 4080]; --reps >= 1")
    if args.handoff_tokens < 3 or args.max_tokens < 1:
        raise SystemExit("bench_disagg: error: --handoff-tokens must be >= 3 and --max-tokens >= 1")
    if args.policy_rounds < 1:
        raise SystemExit("bench_disagg: error: --policy-rounds must be >= 1")
    if not args.trace.is_file() and {"trace", "policies", "sweep"} & set(only):
        raise SystemExit(f"bench_disagg: error: no trace at {args.trace}: pass --trace")
    probe = ProbeConfig(lengths, args.reps, args.max_tokens, args.handoff_tokens, args.transfer_repeat)
    remainders = tuple(int(x) for x in args.threshold_remainders.split(","))
    if any(r < 16 or r % 16 for r in remainders) or args.threshold_reps < 1:
        raise SystemExit(
            "bench_disagg: error: --threshold-remainders must be multiples of 16; --threshold-reps >= 1"
        )
    threshold = ThresholdConfig(remainders, reps=args.threshold_reps, slo_tbt_ms=args.slo_tbt_ms)
    trace = TraceConfig(args.trace, args.trace_start, args.trace_window, args.trace_sample, args.block_tokens,
                        args.output_scale, args.time_scale, args.slo_ttft_ms, args.slo_tbt_ms,
                        policies=tuple(x for x in args.policies.split(",") if x), policy_rounds=args.policy_rounds,
                        policy_store_nodes=args.policy_store_nodes,
                        sweep_scales=_floats(args.sweep_scales), sweep_duration_s=args.sweep_duration)  # fmt: skip
    return only, probe, threshold, trace


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every stack's close()


class Bench:
    """Runs the scenarios in order, printing each one's report as it ends; collects the JSON."""

    def __init__(self, work: Path, shm: Path) -> None:
        self.work, self.shm = work, shm
        self.results: dict[str, Any] = {"scenarios": {}, "problems": [], "leftovers": {}}
        self.stacks = 0

    def problem(self, where: str, exc: BaseException) -> None:
        text = str(exc) if isinstance(exc, StackError) else f"{type(exc).__name__}: {exc}"
        self.results["problems"].append(f"{where}: {text}")
        print(f"PROBLEM in {where}: {text}", flush=True)

    def open_stack(self, spec: StackSpec) -> Stack:
        self.stacks += 1
        print(f"  ... starting `{spec.command}`", flush=True)
        return _Watched(spec, self.work / f"{self.stacks:02d}-{spec.label}", self.shm, self)

    def scenario(
        self, name: str, run: Callable[[], dict[str, Any]], report: Callable[[dict[str, Any]], str]
    ) -> None:
        started = time.monotonic()
        print(f"\n== {name}", flush=True)
        try:
            res = run()
        except Exception as exc:  # noqa: BLE001 - whatever the system did, it is reported, and the next runs
            self.results["scenarios"][name] = {"problem": f"{type(exc).__name__}: {exc}"}
            self.problem(name, exc)
            return
        res["wall_s"] = time.monotonic() - started
        self.results["problems"] += [f"{name}: {p}" for p in res.get("problems", ())]
        self.results["scenarios"][name] = res
        try:
            text = report(res)
        except Exception as exc:  # noqa: BLE001 - a report bug must not lose the other scenarios
            self.problem(f"{name} report", exc)
            return
        print(text + f"\n  ({res['wall_s']:.0f} s)", flush=True)


class _Watched(Stack):
    """A Stack whose region-file leftovers and log tail land in the bench's results."""

    def __init__(self, spec: StackSpec, work: Path, shm: Path, bench: Bench) -> None:
        super().__init__(spec, work, shm)
        self.bench = bench

    def __exit__(self, *exc: object) -> None:
        up = next((c for c in self.group.children if c.spec.name == "yutu-up"), None)
        crashed = up is not None and up.proc.poll() is not None
        super().__exit__(*exc)
        if self.leftovers:
            self.bench.results["leftovers"][self.spec.label] = self.leftovers
            self.bench.results["problems"].append(f"{self.spec.label}: region files left: {self.leftovers}")
        if crashed and exc[0] is None:
            raise StackError(f"`{self.spec.command}` exited during the run:\n{self.log_tail()}")


def _slice_head(cfg: TraceConfig, info: dict[str, Any], load: str) -> str:
    return (f"slice: {info['requests']} requests of {info['conversations']} conversations, trace lines "
            f"{info['lines'][0]}..{info['lines'][1]} (first {cfg.window_s:g} s of {cfg.trace.name} from line "
            f"{cfg.start}, 1 conversation in {cfg.sample}); {cfg.block_tokens} tokens per trace block; {load}; "
            f"SLOs TTFT {cfg.slo_ttft_ms:g} ms, TBT {cfg.slo_tbt_ms:g} ms")  # fmt: skip


REPLAYS = {"sweep": (run_sweep, format_sweep), "trace": (run_trace, format_trace),
           "policies": (run_policies, format_policies)}  # fmt: skip


def run(only: list[str], probe: ProbeConfig, threshold: ThresholdConfig, trace_cfg: TraceConfig, work: Path,
        shm: Path) -> dict[str, Any]:  # fmt: skip
    bench = Bench(work, shm)
    if "store-hit" in only or "handoff" in only:
        try:
            with bench.open_stack(PROBE_STACK) as stack:
                if "store-hit" in only:
                    bench.scenario("store-hit", lambda: run_store_hit(stack, probe), format_store_hit)
                if "handoff" in only:
                    bench.scenario("handoff", lambda: run_handoff(stack, probe), format_handoff)
        except StackError as exc:
            bench.problem("probe stack", exc)
    if "threshold" in only:
        try:
            with bench.open_stack(THRESHOLD_STACK) as stack:
                bench.scenario("threshold", lambda: run_threshold(stack, threshold),
                               lambda res: format_threshold(res, DEFAULT_DISAGG_THRESHOLD))  # fmt: skip
        except StackError as exc:
            bench.problem("threshold stack", exc)
    replays = [s for s in REPLAYS if s in only]
    if not replays:
        return bench.results
    info = bench.results["slice"] = write_slice(trace_cfg, work / "slice.jsonl")
    for name in replays:
        runner, fmt = REPLAYS[name]
        load = (f"time scales {', '.join(f'x{s:g}' for s in trace_cfg.sweep_scales)}, the first "
                f"{trace_cfg.sweep_duration_s:g} s of each" if name == "sweep" else f"time scale x{trace_cfg.time_scale:g}")  # fmt: skip
        head = _slice_head(trace_cfg, info, load)

        def go(runner: Any = runner) -> dict[str, Any]:
            return dict(runner(trace_cfg, Path(info["path"]), bench.open_stack))

        def report(res: dict[str, Any], fmt: Any = fmt, head: str = head) -> str:
            return str(fmt(res, head))

        bench.scenario(name, go, report)
    return bench.results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    only, probe, threshold, trace_cfg = configs(args)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.monotonic()
    shown = sys.argv[1:] if argv is None else argv
    print(f"bench_disagg.py {' '.join(shown)}".rstrip() + f"  (scenarios: {', '.join(only)})", flush=True)
    try:
        with (
            private_dir(Path(tempfile.gettempdir()), WORK_PREFIX, keep=args.keep_logs) as work,
            shm_directory() as shm,
        ):
            if args.keep_logs:
                print(f"logs go to {work} (renamed to {WORK_PREFIX}kept-... at the end)")
            results = run(only, probe, threshold, trace_cfg, work, shm)
    except KeyboardInterrupt:
        print("\ninterrupted: every stack it started is stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    results |= {
        "only": only,
        "wall_s": time.monotonic() - started,
        "argv": shown,
    }
    print(f"\ntotal {results['wall_s']:.0f} s; " + (f"{len(results['problems'])} PROBLEM(S):" if results["problems"]
          else "no problems"))  # fmt: skip
    for problem in results["problems"]:
        print(f"  - {problem}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    return 1 if results["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
