"""The generate channel's transport alone: ZeroMQ ``Peer`` against plain-TCP ``StreamPeer``, same run.

    .venv/bin/python loadtests/bench_channel.py [--messages 3000] [--interval-ms 1] [--rounds 3]

A worker sends one message per engine step to each front end; this is that hop without the rest
of the stack. A router in a child process (the worker's side) sends ``--messages`` TokenDeltas
(one token each, the batch-1 decode case), one every ``--interval-ms`` (an engine step), to a
dealer in this process (the gateway's side), which answers nothing. Printed per transport: CPU
microseconds per message of the sender process and of the receiver process (all their threads,
ZeroMQ's I/O thread included), and the one-way latency p50 / p99 (send to handler,
``CLOCK_MONOTONIC`` is one clock for both processes). Rounds alternate the two transports, and
each figure is the median over rounds: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
from yutu.protocol.generate import CHANNEL, Ping, Pong, TokenDelta
from yutu.rpc import Peer, StreamPeer

TRANSPORTS: dict[str, type[Peer] | type[StreamPeer]] = {"zeromq": Peer, "stream": StreamPeer}


def cpu_s() -> float:
    """User + system CPU seconds of this process, all its threads (CLOCK_PROCESS_CPUTIME_ID)."""
    return time.process_time()


def sender(transport: str, messages: int, interval_s: float, ready: Any, result: Any) -> None:
    """The router: waits for the dealer's Ping, then sends the paced stream; reports its CPU."""

    async def main() -> None:
        started = asyncio.Event()
        identity = [b""]

        def on_ping(sender_id: bytes, msg: Ping) -> None:
            identity[0] = sender_id
            started.set()

        router = TRANSPORTS[transport].router(CHANNEL, {Ping: on_ping})
        ready.send(router.endpoint)
        await started.wait()
        router.send(Pong(0), to=identity[0])
        cpu0 = cpu_s()
        next_at = time.monotonic()
        for i in range(messages):
            next_at += interval_s
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            router.send(TokenDelta(str(time.monotonic_ns()), [i % 8000], num_prompt_tokens=1), to=identity[0])
        cpu = cpu_s() - cpu0
        await asyncio.sleep(0.5)  # the last messages go out
        router.close()
        result.send(cpu)

    uvloop.run(main())


async def one_run(transport: str, messages: int, interval_s: float) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    ready_r, ready_w = ctx.Pipe(duplex=False)
    result_r, result_w = ctx.Pipe(duplex=False)
    child = ctx.Process(target=sender, args=(transport, messages, interval_s, ready_w, result_w), daemon=True)
    child.start()
    loop = asyncio.get_running_loop()
    endpoint = await loop.run_in_executor(None, ready_r.recv)
    latencies_us: list[float] = []
    done = asyncio.Event()
    started = asyncio.Event()

    def on_delta(_: bytes, msg: TokenDelta) -> None:
        latencies_us.append((time.monotonic_ns() - int(msg.request_id)) / 1e3)
        if len(latencies_us) == messages:
            done.set()

    dealer = TRANSPORTS[transport].dealer(
        CHANNEL, {TokenDelta: on_delta, Pong: lambda _s, _m: started.set()}, endpoint
    )
    dealer.send(Ping(0, 10.0))
    await asyncio.wait_for(started.wait(), 30)
    cpu0 = cpu_s()
    await asyncio.wait_for(done.wait(), 60 + messages * interval_s * 4)
    receiver_cpu = cpu_s() - cpu0
    sender_cpu = await loop.run_in_executor(None, result_r.recv)
    dealer.close()
    child.join(10)
    latencies_us.sort()
    return {
        "sender_cpu_us_per_msg": sender_cpu / messages * 1e6,
        "receiver_cpu_us_per_msg": receiver_cpu / messages * 1e6,
        "latency_p50_us": latencies_us[len(latencies_us) // 2],
        "latency_p99_us": latencies_us[int(len(latencies_us) * 0.99)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=3000, help="messages per run")
    parser.add_argument("--interval-ms", type=float, default=1.0, help="time between two sends")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (zeromq, stream), alternating")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in TRANSPORTS}
    for round_no in range(args.rounds):
        for name in TRANSPORTS:
            runs[name].append(uvloop.run(one_run(name, args.messages, args.interval_ms / 1e3)))
        print(f"round {round_no + 1}/{args.rounds} done", flush=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"{'figure':26} {'zeromq':>9} {'stream':>9}  stream/zeromq")
    for figure in medians["zeromq"]:
        z, s = medians["zeromq"][figure], medians["stream"][figure]
        ratio = f"{s / z:.2f}x" if z > 0 else "-"
        print(f"{figure:26} {z:9.1f} {s:9.1f}  {ratio}")
    if args.out is not None:
        args.out.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
