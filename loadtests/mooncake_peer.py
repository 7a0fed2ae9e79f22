"""The real Mooncake Store as a benchmark peer of loadtests/bench_store.py (not a project dependency).

    "$(bash loadtests/setup_mooncake.sh)" loadtests/mooncake_peer.py --out mooncake.json

Runs under the virtualenv that ``loadtests/setup_mooncake.sh`` makes (PyPI
``mooncake-transfer-engine-non-cuda``), never under the project's: bench_store.py starts it as a
child with that interpreter when the virtualenv exists. It starts what Mooncake needs, all on
loopback: ``mooncake_master`` (with its built-in HTTP metadata server, a lease TTL of
``--lease-ms``), a *holder* process that mounts a segment of ``--segment-mib`` and does nothing
else, and -- in this process -- a *client* with no segment of its own, over TCP. Every object the
client puts lands in the holder's segment and every get reads from there over a loopback TCP
connection: the same shape as Yutu's bench (a store node, and a client that holds nothing).

The client measures, for 64 KiB, 1 MiB and 4 MiB objects, cycling over ``--working-set`` MiB of
registered buffers (the zero-copy API, like Yutu's ``put_from``/``get_into`` rows):
``put_from``/``get_into`` (single) and ``batch_put_from``/``batch_get_into`` (32 per call). Puts use
fresh keys; each pass over the working set is removed again, untimed. Mooncake's default lease
(a get pins the object for that long) must outlast a batch: 32 x 4 MiB batch gets fail with
LEASE_EXPIRED under a 100 ms lease, so this peer sets 5 s.

Writes ``{"rows": {"<size>": {"<op>/<mode>": {gbps, p50_us, p99_us, calls}}}, "version": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from mooncake.store import MooncakeDistributedStore

KiB, MiB = 1 << 10, 1 << 20
BATCH = 32
SIZES = [64 * KiB, 1 * MiB, 4 * MiB]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summary(lat: list[float], nbytes: int) -> dict[str, float]:
    arr = np.array(lat)
    return {
        "gbps": nbytes / float(arr.sum()) / 1e9,
        "p50_us": float(np.percentile(arr, 50) * 1e6),
        "p99_us": float(np.percentile(arr, 99) * 1e6),
        "calls": len(lat),
    }


def timed(op: Callable[[int], None], per_call: int, seconds: float,
          between: Callable[[int], None] | None = None) -> dict[str, float]:  # fmt: skip
    """Call ``op(i)`` for about ``seconds`` of measured time (``between(i)`` untimed before each)."""
    lat: list[float] = []
    i = 0
    while sum(lat) < seconds or i < 3:
        if between is not None:
            between(i)
        t = time.perf_counter()
        op(i)
        lat.append(time.perf_counter() - t)
        i += 1
    return summary(lat, i * per_call)


def check(result: Any, what: str) -> None:
    """Mooncake returns 0 (or a non-negative byte count) for success, a negative error code else."""
    values = result if isinstance(result, list) else [result]
    bad = [v for v in values if v < 0]
    if bad:
        raise SystemExit(f"mooncake {what} failed with codes {sorted(set(bad))}")


def connect(metadata_url: str, master: str, segment_bytes: int) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata_url, segment_bytes, 16 * MiB, "tcp", "", master)
    if rc != 0:
        raise SystemExit(f"mooncake setup failed ({rc}): is mooncake_master up at {master}?")
    return store


def holder(metadata_url: str, master: str, segment_bytes: int) -> None:
    """The process that holds the segment: mounts it, says so on stdout, waits for stdin to close."""
    store = connect(metadata_url, master, segment_bytes)
    print("mounted", flush=True)
    sys.stdin.read()
    store.close()


def bench_size(store: MooncakeDistributedStore, src: np.ndarray, dst: np.ndarray, size: int,
               seconds: float) -> dict[str, dict[str, float]]:  # fmt: skip
    n = src.nbytes // size
    sp, dp = src.ctypes.data, dst.ctypes.data
    keys = [f"mc-{size}-g{i}" for i in range(n)]
    for first in range(0, n, BATCH):
        ks = keys[first : first + BATCH]
        check(store.batch_put_from(ks, [sp + (first + j) * size for j in range(len(ks))], [size] * len(ks)),
              "batch_put_from")  # fmt: skip

    def span(i: int) -> tuple[list[str], list[int]]:
        first = (i * BATCH) % n
        ks = keys[first : first + BATCH]
        return ks, [dp + (first + j) * size for j in range(len(ks))]

    out: dict[str, dict[str, float]] = {}
    out["get/single"] = timed(lambda i: check(store.get_into(keys[i % n], dp + (i % n) * size, size), "get_into"),
                              size, seconds)  # fmt: skip
    out["get/batch"] = timed(
        lambda i: check(store.batch_get_into(*span(i), [size] * BATCH), "batch_get_into"),
        size * BATCH,
        seconds,
    )  # fmt: skip  (n is a multiple of BATCH, see main)
    if not np.array_equal(src[: BATCH * size], dst[: BATCH * size]):
        raise SystemExit(f"mooncake returned wrong bytes at {size} B")
    check(store.batch_remove(keys, True), "batch_remove")

    generation = [0]

    def fresh(i: int, count: int) -> list[str]:
        return [f"mc-{size}-p{generation[0]}-{(i * count + j) % n}" for j in range(count)]

    def clear() -> None:
        store.batch_remove([f"mc-{size}-p{generation[0]}-{j}" for j in range(n)], True)  # some absent
        generation[0] += 1

    def cleaner(count: int) -> Callable[[int], None]:
        def clean(i: int) -> None:
            if i and (i * count) % n == 0:
                clear()

        return clean

    def put_batch(i: int) -> None:
        first = (i * BATCH) % n
        ptrs = [sp + (first + j) * size for j in range(BATCH)]
        check(store.batch_put_from(fresh(i, BATCH), ptrs, [size] * BATCH), "batch_put_from")

    out["put/single"] = timed(lambda i: check(store.put_from(fresh(i, 1)[0], sp + (i % n) * size, size), "put_from"),
                              size, seconds, cleaner(1))  # fmt: skip
    clear()
    out["put/batch"] = timed(put_batch, size * BATCH, seconds, cleaner(BATCH))
    clear()
    return out


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mooncake_master exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"mooncake_master did not listen on {port} within {timeout}s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--seconds", type=float, default=0.5, help="measured seconds per data point")
    parser.add_argument("--working-set", type=int, default=128, help="MiB cycled over by every measurement")
    parser.add_argument("--segment-mib", type=int, default=0, help="holder segment (default 4x working set)")
    parser.add_argument("--lease-ms", type=int, default=5000, help="Mooncake's KV lease TTL")
    parser.add_argument("--holder", nargs=2, metavar=("METADATA_URL", "MASTER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    working_set = args.working_set * MiB
    if working_set % (BATCH * max(SIZES)):
        parser.error(f"--working-set must be a multiple of {BATCH * max(SIZES) // MiB} MiB (whole batches)")
    segment = (args.segment_mib or 4 * args.working_set) * MiB
    if args.holder:
        holder(*args.holder, segment)
        return 0
    rpc, http = free_port(), free_port()
    bin_dir = Path(sys.executable).parent
    master = subprocess.Popen(
        [str(bin_dir / "mooncake_master"), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={http}", f"--default_kv_lease_ttl={args.lease_ms}",
         f"--metrics_port={free_port()}", "--enable_metric_reporting=false", "--rpc_thread_num=2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    hold: subprocess.Popen[str] | None = None
    try:
        wait_port(rpc, master, 30)
        wait_port(http, master, 30)
        metadata_url, master_addr = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        hold = subprocess.Popen(
            [sys.executable, __file__, "--out", "-", "--working-set", str(args.working_set),
             "--segment-mib", str(segment // MiB), "--holder", metadata_url, master_addr],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert hold.stdout is not None
        if hold.stdout.readline().strip() != "mounted":
            raise SystemExit("the mooncake holder process did not mount its segment")
        store = connect(metadata_url, master_addr, 0)
        src = np.frombuffer(os.urandom(MiB), np.uint8).repeat(working_set // MiB)
        dst = np.zeros_like(src)
        for buf in (src, dst):
            check(store.register_buffer(buf.ctypes.data, buf.nbytes), "register_buffer")
        rows = {str(size): bench_size(store, src, dst, size, args.seconds) for size in SIZES}
        store.close()
        version = metadata.version("mooncake-transfer-engine-non-cuda")
        Path(args.out).write_text(json.dumps({"rows": rows, "version": version, "lease_ms": args.lease_ms}))
    finally:
        if hold is not None and hold.stdin is not None:
            hold.stdin.close()
            try:
                hold.wait(10)
            except subprocess.TimeoutExpired:
                hold.kill()
        master.terminate()
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
