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

Then the store master's table, which grows after start-up and so cannot be frozen: ``--objects``
objects put and read through the master's real handlers and state (in one process, no sockets),
after ``freeze_startup_heap``; the objects the collector tracks and a full collection's pause,
against the baseline of the same run: as many records shaped as the master kept them before they
were untracked (slots dataclasses, replicas in lists, a NamedTuple descriptor with enums: four
tracked objects per stored object; see services.store_master.objects).
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
from dataclasses import dataclass
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


@dataclass(slots=True)
class _TrackedReplica:  # the baseline: a replica record as the master kept it before
    segment: str
    offset: int | None
    length: int
    state: Any
    medium: Any
    descriptor: Any = None


@dataclass(slots=True)
class _TrackedEntry:
    key: str
    size: int
    replicas: list[_TrackedReplica]
    created_at: float
    pending: Any = None
    lease_until: float = 0.0


def store_master_table(objects: int, repeat: int) -> dict[str, Any]:
    """In this (fresh) process: ``objects`` objects through the master's handlers, then the
    baseline records beside them (see the docstring); full collections timed after each."""
    from yutu.gcpauses import freeze_startup_heap
    from yutu.protocol import store as p
    from yutu.store.types import Medium, ReplicaDescriptor, ReplicaState

    from services.store_master.eager import run_eager
    from services.store_master.handlers import Handlers
    from services.store_master.room import Room
    from services.store_master.settle import Settler
    from services.store_master.state import MasterState, StatePolicy
    from services.store_master.tasks import TaskDispatcher

    state = MasterState(StatePolicy(lease_ttl_s=5.0), time.time)
    tasks = TaskDispatcher()
    settler = Settler(state, None, None, tasks)
    routes = Handlers(state, settler, Room(state, settler, tasks), tasks).routes()

    def call(msg: Any) -> Any:
        return run_eager(routes[type(msg)](msg))

    call(p.BatchMountSegment("node-0", [p.SegmentSpec("seg-0", "dram", 1 << 44, "host-0", 1, 0)]))
    freeze_startup_heap()
    start_objects = len(gc.get_objects())
    for first in range(0, objects, 32):
        keys = [f"object-{i:09d}" for i in range(first, min(objects, first + 32))]
        slots = [p.unwrap(o) for o in call(p.BatchPutStart(keys, [65536] * len(keys), writer="w")).results]
        call(p.BatchPutEnd(keys, [s.put_id for s in slots]))
        call(p.BatchGetReplicas(keys))  # readers' descriptors kept on the replicas
    gc.collect()
    out: dict[str, Any] = {"objects": len(state.objects)}
    out["master_tracked_per_object"] = (len(gc.get_objects()) - start_objects) / objects
    out["master_ms"] = full_collection_ms(repeat)
    before = len(gc.get_objects())
    baseline = []
    for i in range(objects):
        replica = _TrackedReplica("seg-0", i * 65536, 65536, ReplicaState.COMPLETE, Medium.DRAM)
        replica.descriptor = ReplicaDescriptor(
            "seg-0", "dram", i * 65536, 65536, ReplicaState.COMPLETE, "host-0", Medium.DRAM
        )
        baseline.append(_TrackedEntry(f"object-{i:09d}", 65536, [replica], 0.0))
    gc.collect()
    out["baseline_tracked_per_object"] = (len(gc.get_objects()) - before) / objects
    out["both_ms"] = full_collection_ms(repeat)
    del baseline
    return out


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
    parser.add_argument(
        "--objects", type=int, default=100_000, help="objects in the store master's table (its heap)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument(  # the child's part
        "--heap", choices=("engine", "gateway", "store-master"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.objects < 1:
        raise SystemExit("bench_gc: error: --objects must be >= 1")
    if args.heap == "store-master":
        print(json.dumps(store_master_table(args.objects, args.repeat)))
        return
    if args.heap:
        print(json.dumps(measure(args.heap, args.model, args.repeat, args.requests)))
        return
    results: dict[str, Any] = {}
    for heap in ("engine", "gateway", "store-master"):
        argv = [sys.executable, __file__, "--heap", heap, "--repeat", str(args.repeat),
                "--requests", str(args.requests), "--objects", str(args.objects)]  # fmt: skip
        argv += ["--model", args.model] if args.model else []
        child = subprocess.run(argv, capture_output=True, text=True, check=False)
        if child.returncode != 0:
            raise SystemExit(f"the {heap} measurement failed:\n{child.stderr[-3000:]}")
        results[heap] = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"full garbage collection (median of {args.repeat}), each heap in a fresh process:")
    print(
        f"{'heap':8s} {'objects':>9s} {'start-up heap walked':>21s} {'frozen':>9s} {'ratio':>9s}  frozen, after churn"
    )
    table = results.pop("store-master")
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
    baseline_ms = max(table["both_ms"] - table["master_ms"], 1e-3)  # the baseline's share of the walk
    table["baseline_over_master"] = baseline_ms / max(table["master_ms"], 1e-3)
    print(
        f"store master, {table['objects']:,} objects after the start-up freeze: "
        f"{table['master_tracked_per_object']:.2f} tracked objects per stored object, full collection "
        f"{table['master_ms']:.3f} ms; the same records tracked as before "
        f"({table['baseline_tracked_per_object']:.2f} per object): {baseline_ms:.1f} ms more, "
        f"{table['baseline_over_master']:,.0f}x"
    )
    results["store-master"] = table
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
