"""Benchmark of the distributed KV store next to its physical baselines, all in one run.

    python loadtests/bench_store.py --out bench_store.json

Starts what it needs itself (redis-server on a free port, a store master, one store node), then for
64 KiB, 1 MiB and 4 MiB objects measures:

- store put and get, single ops and batches of 32, over TCP (a client limited to ``("tcp",)``) and
  over shared memory (same host), with the bytes API (``put``/``get``: one copy through the staging
  buffer) and the zero-copy API (``put_from``/``get_into``: registered buffers);
- Redis SET/GET of the same values with redis-py's sync client, single and 32 per pipeline, in its
  two configurations: with hiredis (C reply parser and command packer; ``redis-hiredis``) and pure
  Python (``redis-py``: what DESIGN.md's "0.4-0.6 GB/s" figure measured). Neither is best at
  everything -- hiredis reads 1-4 MiB values 6-8x faster, but its packer writes them 4-6x slower
  -- so the ``redis`` baseline the targets are judged on is, per operation, the faster of the two;
- a raw loopback TCP stream (``sendall``/``recv_into`` between two processes) and a plain memcpy
  (``numpy.copyto``) of blocks of the same size; for 1 MiB and up also as many streams side by side
  as the store client's TCP transfers spread a batch over (``socket-lanes``: a batch's bound,
  measured in every round next to the store and the Mooncake peer, its median reported).

Every measurement cycles over a working set of ``--working-set`` bytes (default 128 MiB, past the
CPU caches) so no number is a cache artefact. Throughput is object bytes per second; latency is per
call (a batch call for batches). Prints a table, checks the targets, writes JSON.

The real Mooncake Store runs in the same run, before Yutu's store, when its virtualenv exists
(``bash loadtests/setup_mooncake.sh`` makes it; ``--mooncake PYTHON`` names another interpreter,
``--mooncake off`` skips it): loadtests/mooncake_peer.py measures the same sizes, working set and
single/batch-of-32 zero-copy puts and gets over TCP, and loadtests/mooncake_compare.py prints Yutu /
Mooncake per row and judges issue #10's targets against it (see there).

On a shared machine ``--rounds N`` alternates the Mooncake peer and the store N times and reports
every figure as its median over the rounds, so a change in the machine's load hits both sides.

TCP congestion control: the store's data connections use Reno unless told otherwise
(``yutu.transfer.tcp_wire.DEFAULT_CONGESTION`` says why), and so do the socket baselines, as the
bound of the store's transport; ``--tcp-congestion system`` measures both on the host's default.
The Mooncake peer's sockets always keep the host's default: what its users get.

Cold and warm gets: every get row without a suffix is *cold* -- the client has no lease cache, so
each get asks the master for replicas (one RPC) and then moves the bytes. Rows marked ``warm`` come
from a second client with ``lease_cache=True`` that took the leases of every key untimed just
before: its gets skip the master while the lease lasts (see ``yutu.store.client``). The targets are
judged on the cold rows only; warm ratios are printed as ``[info]`` lines next to them.

Design floors: the protocol fixes a minimum cost per call that no implementation of it can go
below -- a cold get is one master round trip and the copy; a put is one round trip (its commit)
and the copy when it writes into space reserved ahead (single-replica puts of up to
``StoreClientConfig.reserve_bytes`` per call, the default: yutu.store.reservations), else two
(put_start, put_end); its Redis metadata write is written behind (services.store_master.settle). The script measures those pieces in the same run -- a bare TCP
round trip between two processes (clients call the master over its stream RPC, yutu.rpc.stream;
a bare ZeroMQ DEALER/ROUTER round trip, its reference, and a Redis HSET of one metadata record are
printed as information) -- and prints, for every target, the best ratio a call could reach if it
cost nothing but them (bytes at memcpy speed, TCP rows at the socket's speed; no Python at all). A
target whose bound is below its need cannot be met by any implementation of this design on this
machine; one whose bound is above it is missed by our own overheads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis
import uvloop
from redis._parsers import Encoder, _HiredisParser, _RESP2Parser
from redis.connection import PythonRespSerializer

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

from medians import median_of  # noqa: E402
from mooncake_compare import compare, default_python, run_peer  # noqa: E402
from store_baselines import (  # noqa: E402  (this script's folder is on sys.path)
    BATCH,
    KiB,
    MiB,
    bench_floors,
    bench_memcpy,
    bench_redis,
    bench_socket,
    bench_socket_streams,
    summary,
)
from yutu.launcher import ProcessGroup, free_port, python_module, start_redis  # noqa: E402
from yutu.store.client import StoreClient, StoreClientConfig  # noqa: E402
from yutu.transfer.tcp_client import default_lanes  # noqa: E402
from yutu.transfer.tcp_wire import (  # noqa: E402
    DEFAULT_CONGESTION,
    check_congestion,
    congestion_flag,
    host_congestion,
    parse_congestion,
)

SIZES = [64 * KiB, 1 * MiB, 4 * MiB]


# -- the store ---------------------------------------------------------------------------------


class Store:
    """redis-server, a store master and a store node, children of this process (they die with it,
    see :class:`yutu.launcher.ProcessGroup`; logs in ``workdir``); stopped by ``close``."""

    def __init__(
        self, workdir: Path, node_bytes: int, master_spin_us: int | None = None,
        tcp_congestion: str | None = DEFAULT_CONGESTION,
    ) -> None:  # fmt: skip
        """``master_spin_us``: the master's ``--spin-us`` (None: its default); ``tcp_congestion``: the
        node's ``--tcp-congestion`` (None: the host's default)."""
        self.workdir = workdir
        self.master_spin_us = master_spin_us
        self.tcp_congestion = tcp_congestion
        self.group = ProcessGroup(log_dir=workdir)
        self.redis_url = f"redis://127.0.0.1:{free_port()}/0"
        self.prefix = "bench"
        self.node_bytes = node_bytes
        self.master_admin = ""

    def start(self) -> None:
        start_redis(self.group, self.redis_url, self.workdir / "redis")
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}", "OMP_NUM_THREADS": "1"}
        common = ["--redis-url", self.redis_url, "--registry-prefix", self.prefix, "--log-level", "warning"]
        master_admin, node_admin = free_port(), free_port()
        self.master_admin = f"http://127.0.0.1:{master_admin}"
        spin = [] if self.master_spin_us is None else ["--spin-us", str(self.master_spin_us)]
        self.group.spawn("master", python_module("services.store_master.main", *common, "--admin-port",
                                                 str(master_admin), "--instance-id", "bench-master", *spin),
                         ready_url=self.master_admin + "/ready", env=env)  # fmt: skip
        self.group.wait_ready(30)  # the node mounts its segment at the master
        self.group.spawn("node", python_module("services.store_node.main", *common, "--admin-port",
                                               str(node_admin), "--instance-id", "bench-node", "--segment-size",
                                               str(self.node_bytes), "--tcp-congestion",
                                               congestion_flag(self.tcp_congestion)),
                         ready_url=f"http://127.0.0.1:{node_admin}/ready", env=env)  # fmt: skip
        self.group.wait_ready(30)

    def close(self) -> None:
        self.group.stop(grace_s=10)


async def timed(op: Callable[[int], Awaitable[Any]], per_call_bytes: int, seconds: float,
                between: Callable[[int], Awaitable[Any]] | None = None) -> dict[str, float]:  # fmt: skip
    """Call ``op(i)`` for about ``seconds`` of measured time; ``between(i)`` runs untimed before call i."""
    lat: list[float] = []
    i = 0
    while sum(lat) < seconds or i < 3:
        if between is not None:
            await between(i)
        t = time.perf_counter()
        await op(i)
        lat.append(time.perf_counter() - t)
        i += 1
    return summary(lat, i * per_call_bytes, sum(lat))


async def bench_store_size(
    client: StoreClient, warm: StoreClient, size: int, working_set: int, seconds: float, tag: str
) -> dict[str, dict[str, float]]:
    """put/get x single/batch x bytes/zero-copy for one object size through ``client`` (cold gets),
    and warm zero-copy gets through ``warm`` (a client with the lease cache on)."""
    n = working_set // size
    src, dst = client.engine.regions["src"], client.engine.regions["dst"]  # type: ignore[union-attr]
    value = bytes(src.buffer[:size])
    out: dict[str, dict[str, float]] = {}
    keys = [f"{tag}-{size}-g{i}" for i in range(n)]
    offsets = [i * size for i in range(n)]
    for first in range(0, n, BATCH):  # the objects gets will read
        assert all(await client.put_from_batch(keys[first : first + BATCH], src, offsets[first : first + BATCH],
                                               [size] * min(BATCH, n - first)))  # fmt: skip

    def span(i: int) -> tuple[list[str], list[int]]:
        first = (i * BATCH) % n
        return keys[first : first + BATCH], offsets[first : first + BATCH]

    out["get/single/bytes"] = await timed(lambda i: client.get(keys[i % n]), size, seconds)
    out["get/single/zero-copy"] = await timed(
        lambda i: client.get_into(keys[i % n], dst, offsets[i % n]), size, seconds
    )
    out["get/batch/bytes"] = await timed(lambda i: client.get_batch(span(i)[0]), size * BATCH, seconds)
    out["get/batch/zero-copy"] = await timed(
        lambda i: client.get_into_batch(span(i)[0], dst, span(i)[1]), size * BATCH, seconds
    )
    wdst = warm.engine.regions["dst"]  # type: ignore[union-attr]

    async def take_leases() -> None:  # untimed: every key's replicas into the warm client's cache
        for first in range(0, n, BATCH):
            await warm.get_into_batch(keys[first : first + BATCH], wdst, offsets[first : first + BATCH])

    await take_leases()
    out["get/single/zero-copy-warm"] = await timed(
        lambda i: warm.get_into(keys[i % n], wdst, offsets[i % n]), size, seconds
    )
    await take_leases()
    out["get/batch/zero-copy-warm"] = await timed(
        lambda i: warm.get_into_batch(span(i)[0], wdst, span(i)[1]), size * BATCH, seconds
    )
    await client.remove_batch(keys)

    # puts: fresh keys; every pass over the working set is removed again, untimed
    generation = [0]

    def fresh(i: int, count: int) -> list[str]:
        return [f"{tag}-{size}-p{generation[0]}-{(i * count + j) % n}" for j in range(count)]

    def cleaner(count: int) -> Callable[[int], Awaitable[None]]:
        async def clean(i: int) -> None:
            if i and (i * count) % n == 0:
                await client.remove_batch([f"{tag}-{size}-p{generation[0]}-{j}" for j in range(n)])
                generation[0] += 1

        return clean

    async def finish() -> None:
        await client.remove_batch([f"{tag}-{size}-p{generation[0]}-{j}" for j in range(n)])
        generation[0] += 1

    def one_offset(i: int) -> int:
        return (i % n) * size

    out["put/single/bytes"] = await timed(
        lambda i: client.put(fresh(i, 1)[0], value), size, seconds, cleaner(1)
    )
    await finish()
    out["put/single/zero-copy"] = await timed(
        lambda i: client.put_from(fresh(i, 1)[0], src, one_offset(i), size), size, seconds, cleaner(1)
    )
    await finish()
    out["put/batch/bytes"] = await timed(
        lambda i: client.put_batch([(k, value) for k in fresh(i, BATCH)]),
        size * BATCH,
        seconds,
        cleaner(BATCH),
    )
    await finish()
    out["put/batch/zero-copy"] = await timed(
        lambda i: client.put_from_batch(fresh(i, BATCH), src, span(i)[1], [size] * BATCH),
        size * BATCH, seconds, cleaner(BATCH),
    )  # fmt: skip
    await finish()
    return out


async def run_store(
    store: Store, working_set: int, seconds: float, reserve_bytes: int, spin_us: int, congestion: str | None
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for transport, transports in (("tcp", ("tcp",)), ("shm", ("shm", "tcp"))):
        config = StoreClientConfig(store.redis_url, prefix=store.prefix, staging_bytes=BATCH * 4 * MiB + MiB,
                                   transports=transports, reserve_bytes=reserve_bytes, spin_us=spin_us,
                                   tcp_congestion=congestion)  # fmt: skip
        warm_config = dataclasses.replace(config, lease_cache=True, staging_bytes=MiB)
        async with StoreClient(config) as client, StoreClient(warm_config) as warm:
            src = client.register_buffer("src", working_set)
            src.view_numpy()[:] = np.frombuffer(os.urandom(MiB), np.uint8).repeat(working_set // MiB)
            client.register_buffer("dst", working_set).view_numpy()[:] = 0  # touch the pages once
            warm.register_buffer("dst", working_set).view_numpy()[:] = 0
            for size in SIZES:
                results[f"{transport}/{size}"] = await bench_store_size(
                    client, warm, size, working_set, seconds, transport
                )
                print(f"  store over {transport}, {size // KiB} KiB done", flush=True)
    async with httpx.AsyncClient() as http:
        results["master_stats"] = (await http.get(store.master_admin + "/stats", timeout=5)).json()
    return results


# -- report ------------------------------------------------------------------------------------


def report(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    head = f"{'size':>6} {'op':<5} {'mode':<6} {'path':<27} {'GB/s':>7} {'p50 us':>9} {'p99 us':>9}"
    print("\n" + head + "\n" + "-" * len(head))
    for size in SIZES:
        label = f"{size // KiB}K" if size < MiB else f"{size // MiB}M"
        base = res["baselines"][str(size)]
        for name in ("memcpy", "socket"):
            b = base[name]
            print(
                f"{label:>6} {'-':<5} {'-':<6} {name:<27} {b['gbps']:7.2f} {b['p50_us']:9.1f} {b['p99_us']:9.1f}"
            )
        if "socket-lanes" in base:  # only a rate: the streams run side by side
            b = base["socket-lanes"]
            name = f"socket, {b['streams']} streams"
            print(f"{label:>6} {'-':<5} {'-':<6} {name:<27} {b['gbps']:7.2f}")
        for op in ("put", "get"):
            for mode in ("single", "batch"):
                r = base["redis"][f"{op}/{mode}"]
                for name in ("redis-hiredis", "redis-py"):
                    b = base[name][f"{op}/{mode}"]
                    best = (
                        "  <- the baseline" if (r["client"] == "hiredis") == (name == "redis-hiredis") else ""
                    )
                    print(f"{label:>6} {op:<5} {mode:<6} {name:<27} {b['gbps']:7.2f} {b['p50_us']:9.1f} "
                          f"{b['p99_us']:9.1f}{best}")  # fmt: skip
                apis = ("bytes", "zero-copy", "zero-copy-warm") if op == "get" else ("bytes", "zero-copy")
                for transport in ("tcp", "shm"):
                    for api in apis:
                        s = res["store"][f"{transport}/{size}"][f"{op}/{mode}/{api}"]
                        path = f"store {transport} {api.replace('-warm', ' warm')}"
                        print(f"{label:>6} {op:<5} {mode:<6} {path:<27} {s['gbps']:7.2f} {s['p50_us']:9.1f} "
                              f"{s['p99_us']:9.1f}  x{s['gbps'] / r['gbps']:.1f} redis")  # fmt: skip
                        rows.append({"size": size, "op": op, "mode": mode, "transport": transport, "api": api,
                                     **s, "vs_redis": s["gbps"] / r["gbps"]})  # fmt: skip
    return rows


def design_bound(res: dict[str, Any], op: str, nbytes: int, bytes_per_s: float) -> float:
    """Seconds a call moving ``nbytes`` cannot go below (see "Design floors" in the docstring)."""
    rtt = res["floors"]["tcp_rtt"]["p50_us"] * 1e-6  # the master's stream RPC
    reserved = nbytes <= res["reserve_bytes"]  # a put into reservations: its commit only
    return (1 if op == "get" or reserved else 2) * rtt + nbytes / bytes_per_s


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    size = 4 * MiB
    base = res["baselines"][str(size)]
    socket_bps, memcpy_bps = base["socket"]["gbps"] * 1e9, base["memcpy"]["gbps"] * 1e9
    for mode in ("single", "batch"):
        n = size * (BATCH if mode == "batch" else 1)
        tcp = res["store"][f"tcp/{size}"][f"get/{mode}/zero-copy"]["gbps"]
        shm = res["store"][f"shm/{size}"][f"get/{mode}/zero-copy"]["gbps"]
        out.append({"target": f"4 MiB get ({mode}) over TCP >= 60% of the raw socket stream",
                    "ratio": tcp / base["socket"]["gbps"], "need": 0.6,
                    "bound": n / design_bound(res, "get", n, socket_bps) / socket_bps})  # fmt: skip
        out.append({"target": f"4 MiB get ({mode}) over SHM >= 50% of memcpy",
                    "ratio": shm / base["memcpy"]["gbps"], "need": 0.5,
                    "bound": n / design_bound(res, "get", n, memcpy_bps) / memcpy_bps})  # fmt: skip
    for size in SIZES:
        memcpy_bps = res["baselines"][str(size)]["memcpy"]["gbps"] * 1e9
        for op in ("put", "get"):
            for mode in ("single", "batch"):
                n = size * (BATCH if mode == "batch" else 1)
                redis_gbps = res["baselines"][str(size)]["redis"][f"{op}/{mode}"]["gbps"]
                best = max(res["store"][f"{t}/{size}"][f"{op}/{mode}/{api}"]["gbps"]
                           for t in ("tcp", "shm") for api in ("bytes", "zero-copy"))  # fmt: skip
                tcp_bytes = res["store"][f"tcp/{size}"][f"{op}/{mode}/bytes"]["gbps"]
                out.append({"target": f"{size // KiB} KiB {op} ({mode}) beats Redis >= 3x (best cold path)",
                            "ratio": best / redis_gbps, "need": 3.0, "tcp_bytes_ratio": tcp_bytes / redis_gbps,
                            "bound": n / design_bound(res, op, n, memcpy_bps) / 1e9 / redis_gbps})  # fmt: skip
    floors = res["floors"]
    print(f"\ndesign floors (p50): TCP round trip {floors['tcp_rtt']['p50_us']:.1f} us (the master's stream RPC); "
          f"information: ZeroMQ round trip {floors['zmq_rtt']['p50_us']:.1f} us, "
          f"Redis metadata write {floors['redis_write']['p50_us']:.1f} us (written behind)\n")  # fmt: skip
    for t in out:
        t["met"] = t["ratio"] >= t["need"]
        t["reachable"] = t["bound"] >= t["need"]
        extra = f" (TCP bytes API: x{t['tcp_bytes_ratio']:.2f})" if "tcp_bytes_ratio" in t else ""
        verdict = "" if t["met"] else ("" if t["reachable"] else ": out of reach for this design")
        print(f"[{'PASS' if t['met'] else 'MISS'}] {t['target']}: {t['ratio']:.2f}{extra}; "
              f"design bound {t['bound']:.2f}{verdict}")  # fmt: skip
    print("\nagainst pure-Python redis-py alone (DESIGN.md's Redis figure; not counted above):")
    for size in SIZES:
        for op in ("put", "get"):
            ratios = []
            for mode in ("single", "batch"):
                py_gbps = res["baselines"][str(size)]["redis-py"][f"{op}/{mode}"]["gbps"]
                best = max(res["store"][f"{t}/{size}"][f"{op}/{mode}/{api}"]["gbps"]
                           for t in ("tcp", "shm") for api in ("bytes", "zero-copy"))  # fmt: skip
                ratios.append(f"{mode} x{best / py_gbps:.2f}")
            print(f"[info] {size // KiB} KiB {op}: {', '.join(ratios)}")
    print("\nwarm gets (lease cache on; not counted in the targets above):")
    for size in SIZES:
        for mode in ("single", "batch"):
            redis_gbps = res["baselines"][str(size)]["redis"][f"get/{mode}"]["gbps"]
            shm = res["store"][f"shm/{size}"][f"get/{mode}/zero-copy-warm"]["gbps"]
            tcp = res["store"][f"tcp/{size}"][f"get/{mode}/zero-copy-warm"]["gbps"]
            line = f"{size // KiB} KiB get ({mode}) warm: x{shm / redis_gbps:.2f} redis over SHM, x{tcp / redis_gbps:.2f} over TCP"
            if size == 4 * MiB:
                base = res["baselines"][str(size)]
                line += f"; {shm / base['memcpy']['gbps']:.2f} of memcpy, TCP {tcp / base['socket']['gbps']:.2f} of the socket"
            print(f"[info] {line}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench_store.json", help="where to write the JSON results")
    parser.add_argument("--seconds", type=float, default=0.5, help="measured seconds per data point")
    parser.add_argument("--working-set", type=int, default=128, help="MiB cycled over by every measurement")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternate the Mooncake peer and the store this many times; each figure is the "
                        "median over rounds (a shared machine's load drifts)")  # fmt: skip
    parser.add_argument("--mooncake", default="auto",
                        help="the Mooncake peer's python; 'auto': loadtests/setup_mooncake.sh's if made; 'off'")  # fmt: skip
    parser.add_argument("--reserve-bytes", type=int, default=StoreClientConfig.reserve_bytes,
                        help="the store clients' reserve_bytes: single-replica puts of up to this many bytes per "
                        "call write into space reserved ahead (one master RPC); 0 measures the classic "
                        "put_start / put_end protocol (default %(default)s)")  # fmt: skip
    parser.add_argument("--spin-us", type=int, default=StoreClientConfig.spin_us,
                        help="the store clients' spin_us: how long a call waits for the master's reply, and a "
                        "small TCP transfer for the node's, awake before sleeping (yutu.busypoll); 0 measures "
                        "the plain path (default %(default)s)")  # fmt: skip
    parser.add_argument("--master-spin-us", type=int, default=None,
                        help="the store master's --spin-us: how long its stream RPC polls after a reply while "
                        "calls come back to back (default: the master's own default; 0 measures it asleep)")  # fmt: skip
    parser.add_argument("--tcp-congestion", default=congestion_flag(DEFAULT_CONGESTION),
                        help="TCP congestion control of the store's data connections and of the socket "
                        "baselines ('system': the host's default; the Mooncake peer always keeps the host's; "
                        "default %(default)s, the store's own default)")  # fmt: skip
    args = parser.parse_args()
    congestion = parse_congestion(args.tcp_congestion)
    try:
        check_congestion(congestion)
    except ValueError as exc:
        parser.error(str(exc))
    mooncake = (
        None
        if args.mooncake == "off"
        else Path(args.mooncake)
        if args.mooncake != "auto"
        else default_python()
    )
    if args.mooncake == "auto" and not mooncake.exists():  # type: ignore[union-attr]
        print(f"Mooncake peer skipped: no {mooncake} (run: bash loadtests/setup_mooncake.sh)", flush=True)
        mooncake = None
    working_set = args.working_set * MiB
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="yutu-bench-store-"))
    # room for the working set, the objects put meanwhile, and the space of removed objects that the
    # warm client still leases: a removed object's space is freed when its leases end (5 s), so with
    # a short --seconds several sizes' working sets are still held when the next one is put. The
    # master evicts past 90% usage -- the objects a get is about to read, as they are the least
    # recently used -- so the node gets ten working sets: no eviction ever runs during a bench.
    store = Store(workdir, node_bytes=10 * working_set, master_spin_us=args.master_spin_us,
                  tcp_congestion=congestion)  # fmt: skip
    print(f"data connections' TCP congestion control: {args.tcp_congestion} (the host's default, which "
          f"Mooncake's sockets keep: {host_congestion()})", flush=True)  # fmt: skip
    try:
        store.start()
        print(f"services up in {time.perf_counter() - started:.1f}s; baselines...", flush=True)
        url = store.redis_url.rsplit("/", 1)[0] + "/1"  # its own db: flushdb is safe
        r = redis.Redis.from_url(url, parser_class=_HiredisParser)  # hiredis packs commands too
        python_packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        r_py = redis.Redis.from_url(url, parser_class=_RESP2Parser, command_packer=python_packer)
        baselines: dict[str, Any] = {}
        for size in SIZES:
            hi = bench_redis(r, size, working_set, args.seconds)
            py = bench_redis(r_py, size, working_set, args.seconds)
            baselines[str(size)] = {
                "memcpy": bench_memcpy(size, working_set, args.seconds),
                "socket": bench_socket(size, working_set, args.seconds, congestion),
                "redis-hiredis": hi,
                "redis-py": py,
                "redis": {op: {**max(hi[op], py[op], key=lambda b: b["gbps"]),
                               "client": "hiredis" if hi[op]["gbps"] >= py[op]["gbps"] else "python"}
                          for op in hi},
            }  # fmt: skip
        floors = bench_floors(r, args.seconds)
        r.close()
        r_py.close()
        peers, stores, lanes = [], [], []
        for round_ in range(args.rounds):  # alternating, so a change in the machine's load hits both
            if args.rounds > 1:
                print(f"round {round_ + 1} of {args.rounds}", flush=True)
            if mooncake is not None:
                print("Mooncake Store...", flush=True)
                peers.append(run_peer(mooncake, args.seconds, args.working_set, workdir / "mooncake.log"))
            # the loopback's bound for batches, each round between the peer and the store: a busy
            # host moves it as much as it moves them (the report takes the median over the rounds)
            lanes.append({size: bench_socket_streams(size, working_set, args.seconds,
                                                     default_lanes(StoreClientConfig.tcp_connections), congestion)
                          for size in SIZES if size >= MiB})  # fmt: skip
            print("store...", flush=True)
            # the client runs on uvloop, like every Yutu service (yutu.service.run_main)
            stores.append(
                uvloop.run(
                    run_store(store, working_set, args.seconds, args.reserve_bytes, args.spin_us, congestion)
                )
            )
        for size, bound in median_of(lanes).items():
            baselines[str(size)]["socket-lanes"] = {**bound, "streams": lanes[-1][size]["streams"]}
        res = {"baselines": baselines, "floors": floors, "store": median_of(stores)}
        if peers:
            res["mooncake"] = median_of(peers)
    finally:
        store.close()
        shutil.rmtree(workdir, ignore_errors=True)
    rows = report(res)
    res["rows"] = rows
    res["reserve_bytes"] = args.reserve_bytes
    res["spin_us"] = args.spin_us
    res["master_spin_us"] = args.master_spin_us
    res["tcp_congestion"] = args.tcp_congestion
    res["targets"] = targets(res)
    if "mooncake" in res:
        res["mooncake_targets"] = compare(res, SIZES)
    res["config"] = {"working_set": working_set, "seconds": args.seconds, "rounds": args.rounds,
                     "cpus": os.cpu_count(), "batch": BATCH,
                     "elapsed_s": time.perf_counter() - started}  # fmt: skip
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\nwrote {args.out} in {res['config']['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
