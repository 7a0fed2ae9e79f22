"""Batches: many requests, several segments, per-request failures, concurrent submitters."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest
from transfer_helpers import PeerProcess, digest, pattern
from yutu.transfer import TransferEngine, TransferOp, TransferRequest, TransferStatus

MiB = 1 << 20
READ, WRITE = TransferOp.READ, TransferOp.WRITE


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_mixed_batch_with_invalid_requests(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine], transport: str
) -> None:
    size = 8 * MiB
    peer = spawn_peer("b-peer", [f"source:{size}:21", f"sink:{size}:22"])
    engine = make_engine("b-client", transports=(transport,))
    local = engine.register_region("buf", size).view_numpy()
    local[size // 2 :] = pattern(23, size // 2)  # upper half: data to write
    await engine.start()
    source, sink = pattern(21, size), pattern(22, size).copy()

    reads = [
        TransferRequest(READ, "buf", i * 300_000, "b-peer", "source", i * 250_000 + 1, 200_000 + i)
        for i in range(8)
    ]
    writes = [
        TransferRequest(WRITE, "buf", size // 2 + i * 400_000, "b-peer", "sink", i * 500_000 + 3, 300_000 + i)
        for i in range(8)
    ]
    bad = [
        TransferRequest(READ, "nope", 0, "b-peer", "source", 0, 10),  # unknown local region
        TransferRequest(READ, "buf", size - 5, "b-peer", "source", 0, 10),  # local out of range
        TransferRequest(READ, "buf", 0, "b-peer", "nope", 0, 10),  # unknown remote region
        TransferRequest(WRITE, "buf", 0, "b-peer", "sink", size - 5, 10),  # remote out of range
        TransferRequest(READ, "buf", 0, "no-such-segment", "source", 0, 10),  # unknown segment
    ]
    requests = reads[:4] + bad[:2] + writes[:4] + bad[2:] + reads[4:] + writes[4:]
    results = await engine.transfer(requests)

    by_req = dict(zip(requests, results, strict=True))
    for req in reads + writes:
        assert by_req[req].status is TransferStatus.COMPLETED, by_req[req].error
        assert by_req[req].transport == transport
    errors = [by_req[req].error or "" for req in bad]
    assert all(by_req[req].status is TransferStatus.FAILED for req in bad)
    assert "unknown local region 'nope'" in errors[0]
    assert f"[{size - 5}, {size + 5})" in errors[1]
    assert "unknown region 'nope' in segment 'b-peer'" in errors[2]
    assert f"[{size - 5}, {size + 5})" in errors[3] and "sink" in errors[3]
    assert "segment not found" in errors[4]

    for r in reads:
        got = local[r.local_offset : r.local_offset + r.length]
        assert np.array_equal(got, source[r.remote_offset : r.remote_offset + r.length])
    for w in writes:
        sink[w.remote_offset : w.remote_offset + w.length] = local[w.local_offset : w.local_offset + w.length]
    assert await peer.adigest("sink", 0, size) == digest(sink)  # exactly the writes, nothing else


async def test_batch_across_segments_including_our_own(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine]
) -> None:
    spawn_peer("p1", ["data:65536:31"])
    spawn_peer("p2", ["data:65536:32"], transports="tcp")  # offers TCP only: SHM is not an option
    engine = make_engine("self")
    local = engine.register_region("buf", 4 * 65536).view_numpy()
    mirror = engine.register_region("mirror", 65536).view_numpy()
    await engine.start()
    results = await engine.transfer(
        [
            TransferRequest(READ, "buf", 0, "p1", "data", 0, 65536),
            TransferRequest(READ, "buf", 65536, "p2", "data", 0, 65536),
            TransferRequest(READ, "buf", 2 * 65536, "p1", "data", 100, 1000),
        ]
    )
    assert [r.transport for r in results] == ["shm", "tcp", "shm"]
    assert all(r.ok for r in results), results
    assert np.array_equal(local[:65536], pattern(31, 65536))
    assert np.array_equal(local[65536 : 2 * 65536], pattern(32, 65536))
    assert np.array_equal(local[2 * 65536 : 2 * 65536 + 1000], pattern(31, 65536)[100:1100])
    # a segment can address itself
    [r] = await engine.transfer([TransferRequest(READ, "mirror", 0, "self", "buf", 65536, 65536)])
    assert r.ok and np.array_equal(mirror, pattern(32, 65536))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_concurrent_batches_from_several_tasks(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine], transport: str
) -> None:
    size = 16 * MiB
    peer = spawn_peer("c-peer", [f"source:{size}:41", f"sink:{size}:42"])
    engine = make_engine("c-client", transports=(transport,), tcp_connections=3)
    local = engine.register_region("buf", 2 * size).view_numpy()
    local[size:] = pattern(43, size)
    await engine.start()
    source, sink = pattern(41, size), pattern(42, size).copy()
    tasks, chunk = 4, 256 * 1024 + 17
    per_task = size // tasks  # each task owns [t * per_task, (t + 1) * per_task) of every region

    async def worker(t: int) -> None:
        base = t * per_task
        for round_ in range(5):
            reqs = []
            for k in range(6):
                off = base + (round_ * 6 + k) * (chunk // 4)
                reqs.append(TransferRequest(READ, "buf", off, "c-peer", "source", off, chunk))
                reqs.append(TransferRequest(WRITE, "buf", size + off, "c-peer", "sink", off, chunk))
            batch = await engine.submit(reqs)
            results = await batch.wait()
            assert all(r.ok for r in results), [r.error for r in results if not r.ok]

    await asyncio.gather(*(worker(t) for t in range(tasks)))
    for t in range(tasks):
        base = t * per_task
        lo, hi = base, base + 29 * (chunk // 4) + chunk  # the span this task touched
        assert np.array_equal(local[lo:hi], source[lo:hi])
        sink[lo:hi] = local[size + lo : size + hi]
    assert await peer.adigest("sink", 0, size) == digest(sink)


async def test_poll_and_empty_batch(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine]
) -> None:
    spawn_peer("poll-peer", [f"source:{32 * MiB}:51"])
    engine = make_engine("poll-client", transports=("tcp",))
    engine.register_region("buf", 32 * MiB)
    await engine.start()
    assert await engine.transfer([]) == []
    batch = await engine.submit([TransferRequest(READ, "buf", 0, "poll-peer", "source", 0, 32 * MiB)])
    assert batch.poll() == [TransferStatus.PENDING]
    [result] = await batch.wait()
    assert result.ok and batch.done() and batch.poll() == [TransferStatus.COMPLETED]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_many_small_interleaved_reads_and_writes(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine], transport: str
) -> None:
    block = 4096 + 5
    n = 300
    peer = spawn_peer("s-peer", [f"source:{n * block}:71", f"sink:{n * block}:72"])
    engine = make_engine("s-client", transports=(transport,), tcp_connections=2)
    local = engine.register_region("buf", 2 * n * block).view_numpy()
    local[n * block :] = pattern(73, n * block)
    await engine.start()
    requests = []
    for i in range(n):  # READ, WRITE, READ, WRITE ...: every pipeline window is one request long
        op = READ if i % 2 == 0 else WRITE
        local_off = i * block if op is READ else n * block + i * block
        region = "source" if op is READ else "sink"
        requests.append(TransferRequest(op, "buf", local_off, "s-peer", region, i * block, block))
    requests += [
        TransferRequest(READ, "buf", i * block, "s-peer", "source", i * block, block) for i in range(1, n, 2)
    ]
    results = await engine.transfer(requests)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert np.array_equal(local[: n * block], pattern(71, n * block))
    sink = pattern(72, n * block).copy()
    for i in range(1, n, 2):
        sink[i * block : (i + 1) * block] = local[n * block + i * block : n * block + (i + 1) * block]
    assert await peer.adigest("sink", 0, n * block) == digest(sink)


async def test_shm_batch_past_the_inline_limit_is_copied_in_parallel_lanes(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine]
) -> None:
    size = 16 * MiB  # reads + writes of 12 MiB in one batch: past INLINE_BYTES, split into lanes
    peer = spawn_peer("l-peer", [f"source:{size}:71", f"sink:{size}:72"])
    engine = make_engine("l-client", transports=("shm",))
    local = engine.register_region("buf", 2 * size).view_numpy()
    local[size:] = pattern(73, size)
    await engine.start()
    source, sink = pattern(71, size), pattern(72, size).copy()
    chunk = 700_001
    reqs = []
    for k in range(9):
        off = k * chunk + 5 * k
        reqs.append(TransferRequest(READ, "buf", off, "l-peer", "source", off + 3, chunk))
        reqs.append(TransferRequest(WRITE, "buf", size + off, "l-peer", "sink", off, chunk))
    results = await engine.transfer(reqs)
    assert [(r.status, r.transport) for r in results] == [(TransferStatus.COMPLETED, "shm")] * len(reqs)
    for r in reqs:
        if r.op is READ:
            got = local[r.local_offset : r.local_offset + r.length]
            assert np.array_equal(got, source[r.remote_offset : r.remote_offset + r.length])
        else:
            sink[r.remote_offset : r.remote_offset + r.length] = local[
                r.local_offset : r.local_offset + r.length
            ]
    assert await peer.adigest("sink", 0, size) == digest(sink)


def test_shm_lanes_cut_requests_into_pieces_of_equal_bytes() -> None:
    from yutu.transfer.shm import ShmItem, _lanes

    local = np.arange(24, dtype=np.uint8)
    items = [ShmItem(READ, local[a:b], "r", None, 100 + a) for a, b in ((0, 4), (4, 15), (15, 24))]  # type: ignore[arg-type]

    def spans(lane: list[tuple[int, ShmItem]]) -> list[tuple[int, int, int, int]]:
        return [(i, int(p.local[0]), int(p.local[-1]) + 1, p.offset) for i, p in lane]

    lanes, parts = _lanes(items, 24, 2)  # the cut at byte 12 falls inside request 1
    assert [spans(lane) for lane in lanes] == [
        [(0, 0, 4, 100), (1, 4, 12, 104)],
        [(1, 12, 15, 112), (2, 15, 24, 115)],
    ]
    assert parts == [1, 2, 1]
    lanes, parts = _lanes(items, 24, 3)
    assert [spans(lane) for lane in lanes] == [
        [(0, 0, 4, 100), (1, 4, 8, 104)],
        [(1, 8, 15, 108), (2, 15, 16, 115)],
        [(2, 16, 24, 116)],
    ]
    assert parts == [1, 2, 2]
    assert all(p is items[0] for i, p in lanes[0] if i == 0)  # whole requests are not copied views
