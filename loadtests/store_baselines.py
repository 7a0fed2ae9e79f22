"""Baselines for loadtests/bench_store.py, each measured in the same run as the store.

memcpy and a raw loopback TCP stream of blocks of the object size (and as many streams side by side
as the TCP client's lanes, the bound of a batch spread over them; their sockets take the congestion
control the store's data connections use, ``yutu.transfer.tcp_wire.tune_socket``), Redis SET/GET of the same values
(redis-py's sync client, single and 32 per pipeline), and the protocol's fixed costs ("design
floors"): a bare TCP and a bare ZeroMQ round trip, and a Redis write of one metadata record. Every measurement
cycles over a working set past the CPU caches.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
from yutu.launcher import free_port
from yutu.transfer.tcp_wire import tune_socket

KiB, MiB = 1 << 10, 1 << 20
BATCH = 32


def summary(lat: list[float], nbytes: int, elapsed: float) -> dict[str, float]:
    arr = np.array(lat)
    return {
        "gbps": nbytes / elapsed / 1e9,
        "p50_us": float(np.percentile(arr, 50) * 1e6),
        "p99_us": float(np.percentile(arr, 99) * 1e6),
        "calls": len(lat),
    }


# -- baselines ---------------------------------------------------------------------------------


def bench_memcpy(size: int, working_set: int, seconds: float) -> dict[str, float]:
    src = np.frombuffer(os.urandom(MiB), np.uint8).repeat(working_set // MiB)  # (working_set,)
    dst = np.zeros_like(src)
    blocks = working_set // size
    lat: list[float] = []
    moved, i = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        o = (i % blocks) * size
        t = time.perf_counter()
        np.copyto(dst[o : o + size], src[o : o + size])
        lat.append(time.perf_counter() - t)
        moved += size
        i += 1
    return summary(lat, moved, sum(lat))


def _streams_sender(
    port: int, size: int, working_set: int, total: int, streams: int, congestion: str | None
) -> None:
    buf = memoryview(np.frombuffer(os.urandom(MiB), np.uint8).repeat(working_set // MiB).data)
    part = working_set // streams // size * size  # each stream cycles over its own part
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    for c in conns:
        tune_socket(c, congestion)

    def send(k: int) -> None:
        base, blocks = k * part, part // size
        for i in range(total // streams // size):
            o = base + (i % blocks) * size
            conns[k].sendall(buf[o : o + size])

    threads = [threading.Thread(target=send, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in conns:
        c.close()


def bench_socket(size: int, working_set: int, seconds: float, congestion: str | None) -> dict[str, float]:
    """One loopback TCP stream between two processes, ``size`` bytes per send/receive, with the TCP
    congestion control ``congestion`` (None: the host's default)."""
    total = int(3.0e9 * seconds) // size * size  # about `seconds` at 3 GB/s
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        sender = mp.get_context("spawn").Process(
            target=_streams_sender, args=(listener.getsockname()[1], size, working_set, total, 1, congestion)
        )
        sender.start()
        conn, _ = listener.accept()
    tune_socket(conn, congestion)
    buf = memoryview(bytearray(working_set))
    blocks = working_set // size
    lat: list[float] = []
    with conn:
        start = time.perf_counter()
        for i in range(total // size):
            o = (i % blocks) * size
            view, got = buf[o : o + size], 0
            t = time.perf_counter()
            while got < size:
                n = conn.recv_into(view[got:])
                if not n:
                    raise RuntimeError("sender closed early")
                got += n
            lat.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - start
    sender.join(10)
    return summary(lat, total, elapsed)


def bench_socket_streams(
    size: int, working_set: int, seconds: float, streams: int, congestion: str | None
) -> dict[str, float]:
    """``streams`` loopback TCP streams side by side between two processes (a thread per stream on
    each side, ``size`` bytes per send/receive, each over its own part of the working set): what the
    loopback moves when a batch is spread over that many connections, as the TCP client's lanes do.
    Only its rate is meaningful (``gbps``, all streams together)."""
    total = int(4.0e9 * seconds) // (size * streams) * size * streams  # about `seconds` at 4 GB/s
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(streams)
        sender = mp.get_context("spawn").Process(
            target=_streams_sender,
            args=(listener.getsockname()[1], size, working_set, total, streams, congestion),
        )
        sender.start()
        conns = [listener.accept()[0] for _ in range(streams)]
    for c in conns:
        tune_socket(c, congestion)
    buf = memoryview(bytearray(working_set))
    part = working_set // streams // size * size

    def receive(k: int) -> None:
        base, blocks = k * part, part // size
        with conns[k] as conn:
            for i in range(total // streams // size):
                o = base + (i % blocks) * size
                view, got = buf[o : o + size], 0
                while got < size:
                    n = conn.recv_into(view[got:])
                    if not n:
                        raise RuntimeError("sender closed early")
                    got += n

    threads = [threading.Thread(target=receive, args=(k,)) for k in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    sender.join(10)
    return {"gbps": total / elapsed / 1e9, "streams": streams}


def bench_redis(r: redis.Redis, size: int, working_set: int, seconds: float) -> dict[str, dict[str, float]]:
    value = os.urandom(size)
    keys = [f"bench:{size}:{i}" for i in range(working_set // size)]
    out: dict[str, dict[str, float]] = {}

    def run(op: Callable[[int], None], per_call: int) -> dict[str, float]:
        lat: list[float] = []
        i = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            t = time.perf_counter()
            op(i)
            lat.append(time.perf_counter() - t)
            i += 1
        return summary(lat, i * per_call * size, time.perf_counter() - start)

    def batch_keys(i: int) -> list[str]:
        first = (i * BATCH) % len(keys)
        return keys[first : first + BATCH]

    def pipe_set(i: int) -> None:
        pipe = r.pipeline(transaction=False)
        for k in batch_keys(i):
            pipe.set(k, value)
        pipe.execute()

    out["put/single"] = run(lambda i: r.set(keys[i % len(keys)], value), 1)
    out["get/single"] = run(lambda i: r.get(keys[i % len(keys)]), 1)
    out["put/batch"] = run(pipe_set, BATCH)
    out["get/batch"] = run(lambda i: r.mget(batch_keys(i)), BATCH)
    r.flushdb()
    return out


def _zmq_echo(endpoint: str) -> None:
    """A bare ZeroMQ ROUTER that echoes every message: the other end of ``bench_floors``."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        sock.send_multipart(sock.recv_multipart())


def _tcp_echo(port: int) -> None:
    """A bare TCP server that echoes every 77-byte message: the other end of ``bench_floors``."""
    with socket.create_server(("127.0.0.1", port)) as listener:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(77)
        view = memoryview(buf)
        while True:
            got = 0
            while got < len(buf):
                n = conn.recv_into(view[got:])
                if n == 0:
                    return
                got += n
            conn.sendall(buf)


def _tcp_rtt(seconds: float) -> dict[str, float]:
    """A request/response of 77 bytes (a stream RPC frame's 13-byte header and 64 bytes) between
    two processes over loopback TCP: what the master's stream RPC (yutu.rpc.stream) costs at least."""
    port = free_port()
    echo = mp.get_context("spawn").Process(target=_tcp_echo, args=(port,), daemon=True)
    echo.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the TCP echo process did not come up") from None
                time.sleep(0.05)
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg, reply = b"q" * 77, bytearray(77)

            def rtt(_: int) -> None:
                sock.sendall(msg)
                got = 0
                while got < 77:
                    got += sock.recv_into(memoryview(reply)[got:])

            return _timed_sync(rtt, seconds)
    finally:
        echo.kill()
        echo.join(5)


def bench_floors(r: redis.Redis, seconds: float) -> dict[str, dict[str, float]]:
    """The fixed costs of the store protocol (see the module docstring), as p50s: a plain TCP round
    trip between two processes (the master's stream RPC, what clients use), a ZeroMQ round trip
    (8-byte id and a 64-byte message: the master's ZeroMQ RPC, the reference) and a Redis HSET of
    one 120-byte record (written behind a put_end since the write-behind, see
    services.store_master.settle: information only)."""
    import zmq

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    echo = mp.get_context("spawn").Process(target=_zmq_echo, args=(endpoint,), daemon=True)
    echo.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: dict[str, dict[str, float]] = {}
    try:
        sock.send_multipart([b"x" * 8, b"y" * 64])  # waits for the echo process to come up
        if not sock.poll(30_000):
            raise SystemExit("the ZeroMQ echo process did not answer")
        sock.recv_multipart()

        def rtt(_: int) -> None:
            sock.send_multipart([b"x" * 8, b"y" * 64])
            sock.recv_multipart()

        out["zmq_rtt"] = _timed_sync(rtt, seconds)
    finally:
        sock.close()
        echo.kill()
        echo.join(5)
    out["tcp_rtt"] = _tcp_rtt(seconds)
    record = os.urandom(120)
    out["redis_write"] = _timed_sync(lambda i: r.hset("bench:floors", str(i % 1024), record), seconds)
    r.delete("bench:floors")
    return out


def _timed_sync(op: Callable[[int], Any], seconds: float) -> dict[str, float]:
    lat: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        op(len(lat))
        lat.append(time.perf_counter() - t)
    return summary(lat, 0, sum(lat))
