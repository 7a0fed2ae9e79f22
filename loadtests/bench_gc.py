"""Garbage-collector pauses of Yutu's processes, with and without the start-up heap frozen.

    .venv/bin/python loadtests/bench_gc.py [--model DIR] [--out bench_gc.json]

CPython's full (generation 2) collection walks every tracked object, and CPython runs one when
enough objects outlived younger collections since the last: under load, every few tens of seconds.
While it walks, the process does nothing else: an engine process produces no token for any
request. ``yutu.gcpauses.freeze_startup_heap`` (what every service and engine process calls once
started) moves the start-up heap out of those walks. This script measures, each in a fresh child
process so that no heap is shared:

- ``engine``: the heap of a worker's engine process -- an ``LLMEngine`` on the demo model (or
  ``--model``) with the worker's defaults (512 MiB of KV cache), warmed with a few requests;
- ``gateway``: the heap of a front end -- the gateway's, worker's and store's modules imported
  (FastAPI, pydantic, uvicorn, redis, msgspec and our own), no model.

For each: the objects the collector tracks, and the pause of a full collection (median of
``--repeat``) with the heap as start-up left it, then after ``freeze_startup_heap``, then after
serving churn on top (the engine: ``--requests`` more requests through it, finished; so the
objects made after the freeze are in the walk). Prints the ratio unfrozen / frozen per heap.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def full_collection_ms(repeat: int) -> float:
    """Median wall time of ``gc.collect()`` (all generations), in milliseconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def churn(engine: Any, requests: int, vocab: int, seed: int) -> None:
    """Run ``requests`` short requests through ``engine`` to the end (objects made, then freed)."""
    from yutu.engine.sampling import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for start in range(0, requests, 16):
        for i in range(start, min(start + 16, requests)):
            engine.add_request(f"churn-{seed}-{i}", [rng.randrange(10, vocab) for _ in range(64)], params)
        while engine.has_unfinished_requests():
            engine.step()


def measure(heap: str, model: str | None, repeat: int, requests: int) -> dict[str, Any]:
    """In this (fresh) process: build ``heap``, then time full collections (see the docstring)."""
    from yutu.gcpauses import freeze_startup_heap

    engine = None
    if heap == "engine":
        from yutu.engine.engine import EngineConfig, LLMEngine
        from yutu.engine.model_source import resolve_model

        model_dir = resolve_model(model)
        engine = LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_memory_bytes=512 * 2**20))
        churn(engine, 16, engine.model_config.vocab_size, seed=0)
    else:
        import services.gateway.app  # noqa: F401 - the front ends' modules are the heap measured
        import services.store_master.service
        import services.store_node.service
        import services.worker.service  # noqa: F401
    out: dict[str, Any] = {"tracked_objects": len(gc.get_objects())}
    out["unfrozen_ms"] = full_collection_ms(repeat)
    out["frozen_objects"] = freeze_startup_heap()
    out["frozen_ms"] = full_collection_ms(repeat)
    if engine is not None:
        churn(engine, requests, engine.model_config.vocab_size, seed=1)
        out["frozen_after_churn_ms"] = full_collection_ms(repeat)
        out["unfrozen_after_churn"] = len(gc.get_objects())  # get_objects() leaves frozen ones out
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the built-in demo model)")
    parser.add_argument("--repeat", type=int, default=5, help="full collections timed per figure")
    parser.add_argument(
        "--requests", type=int, default=256, help="requests of serving churn after the freeze"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--heap", choices=("engine", "gateway"), help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if args.heap:
        print(json.dumps(measure(args.heap, args.model, args.repeat, args.requests)))
        return
    results: dict[str, Any] = {}
    for heap in ("engine", "gateway"):
        argv = [sys.executable, __file__, "--heap", heap, "--repeat", str(args.repeat),
                "--requests", str(args.requests)] + (["--model", args.model] if args.model else [])  # fmt: skip
        child = subprocess.run(argv, capture_output=True, text=True, check=False)
        if child.returncode != 0:
            raise SystemExit(f"the {heap} measurement failed:\n{child.stderr[-3000:]}")
        results[heap] = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"full garbage collection (median of {args.repeat}), each heap in a fresh process:")
    print(
        f"{'heap':8s} {'objects':>9s} {'start-up heap walked':>21s} {'frozen':>9s} {'ratio':>9s}  frozen, after churn"
    )
    for heap, r in results.items():
        ratio = r["unfrozen_ms"] / max(r["frozen_ms"], 1e-3)  # a walk under a microsecond counts as one
        after = (
            f"{r['frozen_after_churn_ms']:.3f} ms ({r['unfrozen_after_churn']:,} objects walked, after"
            f" {args.requests} more requests)"
            if "frozen_after_churn_ms" in r
            else "-"
        )
        print(
            f"{heap:8s} {r['tracked_objects']:>9,} {r['unfrozen_ms']:>19.1f}ms {r['frozen_ms']:>7.3f}ms"
            f" {ratio:>8,.0f}x  {after}"
        )
        r["unfrozen_over_frozen"] = ratio
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
