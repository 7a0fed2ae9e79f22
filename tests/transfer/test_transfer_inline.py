"""The TCP client's inline path (small batches on the event loop) agrees with the thread path.

The thread path (``tcp_inline_bytes=0``) is the reference: the same mixed batch of READs and WRITEs
-- more requests than one pipeline window, both ops interleaved so windows alternate -- moves the
same bytes with the same per-request results through both, and through the inline path that
sleeps at once on a socket with nothing to read (``tcp_spin_us=0``, not polling: yutu.busypoll),
against a peer in another process; a killed peer fails them the same way.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import numpy as np
import pytest
from transfer_helpers import PeerProcess, digest, pattern
from yutu import busypoll
from yutu.transfer import TransferEngine, TransferOp, TransferRequest, TransferStatus, tcp_inline
from yutu.transfer.tcp_client import PIPELINE_WINDOW

KiB = 1 << 10
READ, WRITE = TransferOp.READ, TransferOp.WRITE
SIZE = 4 << 20


def mixed_batch(segment: str, sink: str) -> list[TransferRequest]:
    """70 requests, 1.6 MiB in all (under the inline bound): 40 reads, 20 writes, 10 reads."""
    sizes = [(7 * i % 13 + 1) * 2 * KiB + i for i in range(70)]  # odd sizes, 2-28 KiB
    out, local = [], 0
    for i, n in enumerate(sizes):
        op = WRITE if 40 <= i < 60 else READ
        region, remote = ("source", 3 + i * 40 * KiB) if op is READ else (sink, 5 + i * 30 * KiB)
        local_offset = local if op is READ else SIZE // 2 + local
        out.append(TransferRequest(op, "buf", local_offset, segment, region, remote, n))
        local += n + 17
    return out


async def run(
    engine: TransferEngine, peer: PeerProcess, sink: str
) -> tuple[list[TransferStatus], np.ndarray]:
    """Warm the pool, run the mixed batch, return the statuses and what the reads landed."""
    assert (await engine.transfer([TransferRequest(READ, "buf", 0, "inl-peer", "source", 0, 4 * KiB)]))[0].ok
    requests = mixed_batch("inl-peer", sink)
    results = await engine.transfer(requests)
    assert all(r.transport == "tcp" for r in results), [r.error for r in results if not r.ok]
    return [r.status for r in results], engine.regions["buf"].view_numpy(0, SIZE // 2).copy()


async def test_inline_and_thread_paths_move_the_same_bytes(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine]
) -> None:
    sinks = [f"sink-{x}:{SIZE}:72" for x in "abc"]
    peer = spawn_peer("inl-peer", [f"source:{SIZE}:71", *sinks], "tcp")
    fast = make_engine("inl-fast", transports=("tcp",))
    plain = make_engine("inl-plain", transports=("tcp",), tcp_inline_bytes=0)
    sleepy = make_engine("inl-sleepy", transports=("tcp",), tcp_spin_us=0)
    assert fast._tcp.spin_s > 0 and sleepy._tcp.spin_s == 0
    for engine in (fast, plain, sleepy):
        engine.register_region("buf", SIZE).view_numpy()[SIZE // 2 :] = pattern(73, SIZE // 2)
        await engine.start()
    assert len(mixed_batch("x", "y")) > 2 * PIPELINE_WINDOW

    fast_status, fast_read = await run(fast, peer, "sink-a")
    plain_status, plain_read = await run(plain, peer, "sink-b")
    sleepy_status, sleepy_read = await run(sleepy, peer, "sink-c")

    # the warm-up connects on the thread path; the batch then runs inline on the pooled connection
    assert fast._tcp.inline_batches == sleepy._tcp.inline_batches == 1 and plain._tcp.inline_batches == 0
    assert fast_status == plain_status == sleepy_status == [TransferStatus.COMPLETED] * 70
    assert np.array_equal(fast_read, plain_read) and np.array_equal(sleepy_read, plain_read)
    source, sink = pattern(71, SIZE), pattern(72, SIZE).copy()
    local = fast.regions["buf"].view_numpy()
    for r in mixed_batch("inl-peer", "sink-a"):
        if r.op is READ:
            assert np.array_equal(fast_read[r.local_offset : r.local_offset + r.length],
                                  source[r.remote_offset : r.remote_offset + r.length])  # fmt: skip
        else:
            sink[r.remote_offset : r.remote_offset + r.length] = local[
                r.local_offset : r.local_offset + r.length
            ]
    expected = digest(sink)
    assert [await peer.adigest(f"sink-{x}", 0, SIZE) for x in "abc"] == [expected] * 3


async def test_a_killed_peer_fails_both_paths_alike(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine]
) -> None:
    peer = spawn_peer("inl-peer", [f"source:{SIZE}:74"], "tcp")
    fast = make_engine("inl-fast", transports=("tcp",))
    plain = make_engine("inl-plain", transports=("tcp",), tcp_inline_bytes=0)
    req = TransferRequest(READ, "buf", 0, "inl-peer", "source", 0, 64 * KiB)
    for engine in (fast, plain):
        engine.register_region("buf", SIZE)
        await engine.start()
        assert (await engine.transfer([req]))[0].ok  # a warm pooled connection
    peer.kill()
    fast_results = await fast.transfer([req, req], timeout_s=10)
    plain_results = await plain.transfer([req, req], timeout_s=10)
    assert fast._tcp.inline_batches == 1
    for results in (fast_results, plain_results):
        assert [r.status for r in results] == [TransferStatus.FAILED] * 2
        # the peer was re-read from the directory and found dead, not retried or left hanging
        assert all(f"segment 'inl-peer' (pid {peer.pid} on " in (r.error or "") for r in results)
        assert all("is unreachable" in (r.error or "") for r in results)


async def test_small_items_move_as_vector_requests_and_a_refused_range_fails_only_its_item(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine]
) -> None:
    """64 reads of 32 KiB (a demo-model KV block each) from scattered offsets are one READV, 64
    writes one WRITEV, on both paths; with one range out of bounds the vector is refused and asked
    again range by range, so only that item fails and every other lands."""
    peer = spawn_peer("vec-peer", [f"source:{SIZE}:75", f"sink-a:{SIZE}:76", f"sink-b:{SIZE}:76"], "tcp")
    fast = make_engine("vec-fast", transports=("tcp",))
    plain = make_engine("vec-plain", transports=("tcp",), tcp_inline_bytes=0)
    block, source = 32 * KiB, pattern(75, SIZE)
    remote = [(k * 37 % 64) * (48 * KiB) + k for k in range(64)]  # out of order, unaligned

    def reads(bad: int | None) -> list[TransferRequest]:
        return [TransferRequest(READ, "buf", k * block, "vec-peer", "source",
                                SIZE - 100 if k == bad else remote[k], block) for k in range(64)]  # fmt: skip

    for engine, sink in ((fast, "sink-a"), (plain, "sink-b")):
        engine.register_region("buf", SIZE).view_numpy()[SIZE // 2 :] = pattern(77, SIZE // 2)
        await engine.start()
        assert (await engine.transfer(reads(None)[:1]))[0].ok  # a warm pooled connection
        writes = [TransferRequest(WRITE, "buf", SIZE // 2 + k * block, "vec-peer", sink, remote[k], block)
                  for k in range(64)]  # fmt: skip
        for batch in (reads(None), writes):
            first = next(engine._tcp._ids)
            assert all(r.ok for r in await engine.transfer(batch))
            assert next(engine._tcp._ids) - first - 1 == 1  # one request for 64 items
        landed = engine.regions["buf"].view_numpy()
        for k in range(64):
            assert np.array_equal(landed[k * block : (k + 1) * block], source[remote[k] : remote[k] + block])
        engine.regions["buf"].view_numpy()[: SIZE // 2] = 0
        results = await engine.transfer(reads(20))
        assert [r.status for r in results] == [TransferStatus.COMPLETED] * 20 + [TransferStatus.FAILED] + [
            TransferStatus.COMPLETED
        ] * 43
        assert "outside region 'source'" in (results[20].error or "")
        assert not landed[20 * block : 21 * block].any()
        for k in (*range(20), *range(21, 64)):
            assert np.array_equal(landed[k * block : (k + 1) * block], source[remote[k] : remote[k] + block])
    assert fast._tcp.inline_batches == 3 and plain._tcp.inline_batches == 0
    sink = pattern(76, SIZE).copy()
    written = pattern(77, SIZE // 2)
    for k in range(64):
        sink[remote[k] : remote[k] + block] = written[k * block : (k + 1) * block]
    assert await peer.adigest("sink-a", 0, SIZE) == await peer.adigest("sink-b", 0, SIZE) == digest(sink)


class _Clock:
    """A ``time`` whose ``perf_counter`` moves 1 ms each time it is read: the poll budget of the
    inline path, in steps that do not depend on the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.001
        return self.now


def _count_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every time the inline path sleeps on its socket (True: for writability)."""
    monkeypatch.setattr(busypoll, "time", _Clock())
    sleeps: list[bool] = []
    real_wait = tcp_inline._wait

    async def wait(loop: asyncio.AbstractEventLoop, sock: socket.socket, writable: bool) -> None:
        sleeps.append(writable)
        await real_wait(loop, sock, writable)

    monkeypatch.setattr(tcp_inline, "_wait", wait)
    return sleeps


async def test_a_payload_that_keeps_streaming_in_never_puts_the_loop_to_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The poll budget counts silence, not the whole call: 40 pieces, each a few polls after the
    last, take many budgets in all and are read without sleeping; a silence longer than the
    budget still sleeps."""
    sleeps = _count_sleeps(monkeypatch)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    pieces = [bytes([i]) * 1000 for i in range(40)]

    async def feed(gap: int, last_gap: int) -> None:
        for i, piece in enumerate(pieces):
            for _ in range(last_gap if i == len(pieces) - 1 else gap):
                await asyncio.sleep(0)
            theirs.send(piece)

    try:
        loop = asyncio.get_running_loop()
        for last_gap, slept in ((3, False), (30, True)):  # 30 polls: 30 ms of silence, over 10
            sleeps.clear()
            view = memoryview(bytearray(40_000))
            feeder = asyncio.ensure_future(feed(3, last_gap))
            await tcp_inline.recv_into(loop, ours, view, spin_s=0.010)
            await feeder
            assert bytes(view) == b"".join(pieces)
            assert bool(sleeps) is slept, sleeps
    finally:
        ours.close()
        theirs.close()


async def test_a_send_the_peer_keeps_draining_never_puts_the_loop_to_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same for a send bigger than the socket buffer, which the other side reads a little at a
    time: polled, not slept on, while it moves."""
    sleeps = _count_sleeps(monkeypatch)
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * KiB)
    ours.setblocking(False)
    payload = bytes(range(256)) * 2048  # 512 KiB
    got = bytearray()

    async def drain() -> None:
        theirs.setblocking(False)
        while len(got) < 4 + len(payload):
            for _ in range(3):
                await asyncio.sleep(0)
            try:
                got.extend(theirs.recv(16 * KiB))
            except BlockingIOError:
                pass

    try:
        reader = asyncio.ensure_future(drain())
        await tcp_inline.send(asyncio.get_running_loop(), ours, [b"head", payload], spin_s=0.010)
        await reader
        assert bytes(got) == b"head" + payload
        assert not sleeps, sleeps
    finally:
        ours.close()
        theirs.close()
