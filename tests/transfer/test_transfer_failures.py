"""Failures: server-side bounds refusal, dead and stalled peers, vanished and restarted segments."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable

import numpy as np
import pytest
from transfer_helpers import PeerProcess, digest, pattern
from yutu.transfer import SegmentDirectory, TransferEngine, TransferOp, TransferRequest, TransferStatus
from yutu.transfer.tcp_client import PeerAddress, TcpClient, TcpItem
from yutu.transfer.tcp_wire import (
    REPLY,
    WireOp,
    WireStatus,
    decode_reply_header,
    encode_request,
    encode_vector_request,
    recv_exact,
)
from yutu.transfer.transport import COMPLETED, Outcome

MiB = 1 << 20
READ, WRITE = TransferOp.READ, TransferOp.WRITE


def reply(sock: socket.socket) -> tuple[int, str]:
    status, msg_len, _, _ = decode_reply_header(recv_exact(sock, REPLY.size))
    return status, recv_exact(sock, msg_len).decode()


async def test_server_refuses_out_of_range_and_touches_nothing(
    spawn_peer: Callable[..., PeerProcess], directory: SegmentDirectory
) -> None:
    size = 65536
    peer = spawn_peer("srv", [f"data:{size}:61"])
    desc = await directory.lookup("srv")
    before = digest(pattern(61, size))

    def talk() -> None:
        with socket.create_connection((desc.tcp_host, desc.tcp_port), timeout=10) as s:
            # nothing is served before the handshake
            s.sendall(encode_request(WireOp.READ, 1, b"data", 0, 10))
            assert reply(s)[0] == WireStatus.BAD_REQUEST
        with socket.create_connection((desc.tcp_host, desc.tcp_port), timeout=10) as s:
            s.sendall(encode_request(WireOp.HELLO, 0, b"srv", desc.incarnation + 1, 0))
            assert reply(s)[0] == WireStatus.WRONG_SEGMENT  # a stale incarnation is turned away
        with socket.create_connection((desc.tcp_host, desc.tcp_port), timeout=10) as s:
            s.sendall(encode_request(WireOp.HELLO, 0, b"srv", desc.incarnation, 0))
            assert reply(s) == (WireStatus.OK, "")
            junk = b"\xff" * 4096
            for name, offset, length, want in [
                (b"data", size - 100, 4096, WireStatus.OUT_OF_RANGE),  # straddles the end
                (b"data", size, 1, WireStatus.OUT_OF_RANGE),  # starts at the end
                (b"data", (1 << 64) - 1, 4096, WireStatus.OUT_OF_RANGE),  # would wrap in C
                (b"data", 0, 0, WireStatus.OUT_OF_RANGE),  # empty
                (b"nope", 0, 4096, WireStatus.UNKNOWN_REGION),
            ]:
                s.sendall(encode_request(WireOp.WRITE, 2, name, offset, length) + junk[:length])
                status, msg = reply(s)
                assert status == want, msg
                s.sendall(encode_request(WireOp.READ, 3, name, offset, length))
                assert reply(s)[0] == want
            # the stream is still in step: a valid READ on the same connection returns the data
            s.sendall(encode_request(WireOp.READ, 4, b"data", 100, 50))
            assert reply(s) == (WireStatus.OK, "")
            assert recv_exact(s, 50) == pattern(61, size)[100:150].tobytes()
            # a vector request with one bad range is refused as a whole, naming that range
            bad = [(0, 100), (size - 10, 20), (200, 30)]
            s.sendall(encode_vector_request(WireOp.WRITEV, 5, b"data", bad) + junk[:150])
            assert reply(s) == (WireStatus.OUT_OF_RANGE, f"range 1 of 3: range [{size - 10}, {size + 10}) "
                                                         f"is outside region 'data' of {size} bytes")  # fmt: skip
            s.sendall(encode_vector_request(WireOp.READV, 6, b"data", bad))
            assert reply(s)[0] == WireStatus.OUT_OF_RANGE
            s.sendall(encode_vector_request(WireOp.READV, 7, b"nope", [(0, 1), (1, 1)]))
            assert reply(s)[0] == WireStatus.UNKNOWN_REGION
            # and a valid one moves its ranges back to back
            s.sendall(encode_vector_request(WireOp.READV, 8, b"data", [(300, 7), (10, 5), (300, 2)]))
            assert reply(s) == (WireStatus.OK, "")
            data = pattern(61, size)
            assert recv_exact(s, 14) == b"".join(
                data[a : a + n].tobytes() for a, n in [(300, 7), (10, 5), (300, 2)]
            )

    await asyncio.to_thread(talk)
    assert await peer.adigest("data", 0, size) == before


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_engine_out_of_range_fails_without_change(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine], transport: str
) -> None:
    peer = spawn_peer("oor", [f"data:{MiB}:62"])
    engine = make_engine("oor-client", transports=(transport,))
    engine.register_region("buf", 2 * MiB).view_numpy()[:] = 7
    await engine.start()
    results = await engine.transfer(
        [
            TransferRequest(WRITE, "buf", 0, "oor", "data", MiB - 10, 2 * 4096),
            TransferRequest(WRITE, "buf", 0, "oor", "data", 0, MiB + 1),
            TransferRequest(READ, "buf", 0, "oor", "data", 0, 4096),
        ]
    )
    assert [r.status for r in results] == [
        TransferStatus.FAILED,
        TransferStatus.FAILED,
        TransferStatus.COMPLETED,
    ]
    assert "outside region 'data'" in (results[0].error or "")
    assert await peer.adigest("data", 0, MiB) == digest(pattern(62, MiB))


async def test_peer_killed_mid_transfer_fails_without_hanging(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine]
) -> None:
    peer = spawn_peer("victim", [f"data:{64 * MiB}:63"])
    survivor = spawn_peer("survivor", [f"data:{MiB}:64"])
    engine = make_engine("killer", transports=("tcp",))
    engine.register_region("buf", 64 * MiB)
    engine.register_region("small", MiB)
    await engine.start()
    chunk = 16 * MiB
    doomed = [
        TransferRequest(READ, "buf", (i % 4) * chunk, "victim", "data", (i % 4) * chunk, chunk)
        for i in range(128)
    ]
    healthy = TransferRequest(READ, "small", 0, "survivor", "data", 0, MiB)
    batch = await engine.submit([*doomed, healthy], timeout_s=60)
    for _ in range(2500):  # until the first request finished (at most ~5 s)
        if TransferStatus.COMPLETED in batch.poll()[:-1]:
            break
        await asyncio.sleep(0.002)
    peer.kill()  # SIGKILL
    results = await asyncio.wait_for(batch.wait(), timeout=20)
    statuses = [r.status for r in results[:-1]]
    assert set(statuses) <= {TransferStatus.COMPLETED, TransferStatus.FAILED}
    failed = [r for r in results[:-1] if r.status is TransferStatus.FAILED]
    assert failed, "the peer died before anything failed: make the batch longer"
    assert all("victim" in (r.error or "") for r in failed)
    assert results[-1].ok  # a request to another peer in the same batch is unaffected
    assert np.array_equal(engine.regions["small"].view_numpy(), pattern(64, MiB))
    # a later batch to the dead segment fails fast too
    t1 = time.monotonic()
    [again] = await engine.transfer([doomed[0]], timeout_s=10)
    assert again.status is TransferStatus.FAILED and time.monotonic() - t1 < 5
    survivor.quit()


async def test_stalled_peer_times_out_and_recovers(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine]
) -> None:
    peer = spawn_peer("sleepy", [f"data:{MiB}:65"])
    other = spawn_peer("awake", [f"data:{MiB}:66"])
    engine = make_engine("waiter", transports=("tcp",), tcp_connections=2)
    engine.register_region("buf", 2 * MiB)
    await engine.start()
    to_sleepy = TransferRequest(READ, "buf", 0, "sleepy", "data", 0, MiB)
    to_awake = TransferRequest(READ, "buf", MiB, "awake", "data", 0, MiB)
    assert all(r.ok for r in await engine.transfer([to_sleepy, to_awake]))  # pools are warm
    peer.stop()  # SIGSTOP: the kernel still accepts connections, nobody answers
    try:
        t0 = time.monotonic()
        results = await engine.transfer([to_sleepy, to_sleepy, to_awake], timeout_s=0.5)
        elapsed = time.monotonic() - t0
        assert [r.status for r in results] == [
            TransferStatus.TIMED_OUT,
            TransferStatus.TIMED_OUT,
            TransferStatus.COMPLETED,
        ]
        assert 0.4 < elapsed < 5.0
    finally:
        peer.resume()
    [result] = await engine.transfer([to_sleepy])
    assert result.ok
    assert np.array_equal(engine.regions["buf"].view_numpy(0, MiB), pattern(65, MiB))
    other.quit()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_vanished_segment_is_not_found(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine], transport: str
) -> None:
    peer = spawn_peer("gone", [f"data:{MiB}:67"])
    engine = make_engine("seeker", transports=(transport,))
    engine.register_region("buf", MiB)
    await engine.start()
    req = TransferRequest(READ, "buf", 0, "gone", "data", 0, 4096)
    assert (await engine.transfer([req]))[0].ok  # descriptor cached, connection/mapping warm
    await asyncio.to_thread(peer.quit)  # withdraws the segment and unlinks its memory
    [result] = await engine.transfer([req], timeout_s=5)
    assert result.status is TransferStatus.FAILED
    assert "segment not found" in (result.error or "")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_restarted_segment_is_found_again(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine], transport: str
) -> None:
    first = spawn_peer("phoenix", [f"data:{MiB}:68"])
    engine = make_engine("watcher", transports=(transport,))
    local = engine.register_region("buf", MiB).view_numpy()
    await engine.start()
    req = TransferRequest(READ, "buf", 0, "phoenix", "data", 0, MiB)
    assert (await engine.transfer([req]))[0].ok
    await asyncio.to_thread(first.quit)
    await asyncio.to_thread(spawn_peer, "phoenix", [f"data:{MiB}:69"])  # same name, new incarnation
    [result] = await engine.transfer([req])  # the cached descriptor is stale: refreshed and retried
    assert result.ok, result.error
    assert np.array_equal(local, pattern(69, MiB))


async def test_region_registered_after_lookup_is_found(
    make_engine: Callable[..., TransferEngine],
) -> None:
    server = make_engine("late")
    await server.start()
    client = make_engine("early", transports=("tcp",))
    client.register_region("buf", 4096)
    await client.start()
    [miss] = await client.transfer([TransferRequest(READ, "buf", 0, "late", "fresh", 0, 16)])
    assert miss.status is TransferStatus.FAILED and "unknown region 'fresh'" in (miss.error or "")
    server.register_region("fresh", 4096).view_numpy()[:16] = np.arange(16, dtype=np.uint8)
    await server.publish()
    [hit] = await client.transfer([TransferRequest(READ, "buf", 0, "late", "fresh", 0, 16)])
    assert hit.ok and client.regions["buf"].view_numpy(0, 16).tolist() == list(range(16))
    server.unregister_region("fresh")
    await server.publish()
    [refused] = await client.transfer([TransferRequest(READ, "buf", 0, "late", "fresh", 0, 16)])
    assert refused.status is TransferStatus.FAILED


async def test_closing_the_engine_fails_in_flight_batches(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine]
) -> None:
    spawn_peer("busy", [f"data:{32 * MiB}:75"])
    engine = make_engine("quitter", transports=("tcp",))
    engine.register_region("buf", 32 * MiB)
    await engine.start()
    reqs = [TransferRequest(READ, "buf", 0, "busy", "data", 0, 32 * MiB) for _ in range(32)]
    batch = await engine.submit(reqs)
    await asyncio.sleep(0.05)
    await asyncio.wait_for(engine.close(), timeout=10)
    results = await asyncio.wait_for(batch.wait(), timeout=10)
    assert {r.status for r in results} <= {TransferStatus.COMPLETED, TransferStatus.FAILED}
    assert any(r.status is TransferStatus.FAILED for r in results)


async def test_simultaneous_starts_under_one_name_leave_one_winner(
    make_engine: Callable[..., TransferEngine],
) -> None:
    a, b = make_engine("twin"), make_engine("twin")
    outcomes = await asyncio.gather(a.start(), b.start(), return_exceptions=True)
    assert sorted(type(o).__name__ for o in outcomes) == ["NoneType", "SegmentConflictError"]


async def test_same_host_peer_without_a_mappable_file_is_reached_over_tcp(
    spawn_peer: Callable[..., PeerProcess],
    make_engine: Callable[..., TransferEngine],
    directory: SegmentDirectory,
) -> None:
    spawn_peer("hidden", [f"a:{MiB}:76", f"b:{MiB}:77"])
    engine = make_engine("finder")  # shm and tcp
    local = engine.register_region("buf", 2 * MiB).view_numpy()
    await engine.start()
    desc = await directory.lookup("hidden")
    [warm] = await engine.transfer([TransferRequest(READ, "buf", 0, "hidden", "a", 0, MiB)])
    assert warm.ok and warm.transport == "shm"
    for name in ("a", "b"):  # someone cleans /dev/shm under a live peer
        os.unlink(desc.regions[name].path)
    results = await engine.transfer(
        [
            TransferRequest(READ, "buf", 0, "hidden", "a", 0, MiB),  # was mapped: fails over to TCP
            TransferRequest(READ, "buf", MiB, "hidden", "b", 0, MiB),  # never mapped: TCP from the start
        ]
    )
    assert [(r.status, r.transport) for r in results] == [(TransferStatus.COMPLETED, "tcp")] * 2
    assert np.array_equal(local[:MiB], pattern(76, MiB))
    assert np.array_equal(local[MiB:], pattern(77, MiB))


async def test_mappings_of_departed_regions_are_pruned(make_engine: Callable[..., TransferEngine]) -> None:
    owner = make_engine("owner")
    owner.register_region("data", MiB).view_numpy()[:] = 5
    await owner.start()
    reader = make_engine("reader")
    reader.register_region("buf", MiB)
    await reader.start()
    [r] = await reader.transfer([TransferRequest(READ, "buf", 0, "owner", "data", 0, MiB)])
    assert r.ok and r.transport == "shm"
    assert reader._shm.prune() == 0  # still there: kept
    owner.unregister_region("data")  # unlinks the file; our mapping alone would keep its pages
    await owner.publish()
    assert reader._shm.prune() == 1


async def test_a_lane_on_a_dead_pooled_connection_leaves_the_rest_to_the_others(
    spawn_peer: Callable[..., PeerProcess], make_engine: Callable[..., TransferEngine]
) -> None:
    """Lanes take slices from one queue: when one lane's pooled connection turns out dead, only
    the slices it had in flight fail (as unreachable, so the engine would look the peer up again);
    the other lane moves everything else."""
    spawn_peer("lanes-peer", [f"data:{16 * MiB}:65"], "tcp")
    engine = make_engine("lanes", transports=("tcp",))
    await engine.start()
    client = TcpClient(connections=2, slice_bytes=MiB, lanes=2, inline_bytes=0)
    try:
        found = await engine.directory.lookup("lanes-peer")
        peer = PeerAddress(found.tcp_host, found.tcp_port, found.name, found.incarnation)
        pool = client._pool(peer)
        stale = pool.acquire(time.monotonic() + 10)  # a handshaken connection that dies idle
        stale.shutdown(socket.SHUT_RDWR)
        pool.release(stale, healthy=True)
        local = bytearray(16 * MiB)
        items = [TcpItem(WireOp.READ, memoryview(local)[i * MiB : (i + 1) * MiB], b"data", i * MiB)
                 for i in range(16)]  # fmt: skip
        outcomes: dict[int, Outcome] = {}
        await client.execute(peer, items, time.monotonic() + 30, outcomes.__setitem__)
    finally:
        client.close()
    assert sorted(outcomes) == list(range(16))
    failed = [i for i, o in outcomes.items() if o is not COMPLETED]
    assert 1 <= len(failed) <= 2, outcomes  # the dead lane's first requests in flight, no more
    assert all(outcomes[i].unreachable and outcomes[i].peer_failed for i in failed)
    source = pattern(65, 16 * MiB)
    for i in set(range(16)) - set(failed):
        assert np.array_equal(np.frombuffer(local, np.uint8)[i * MiB : (i + 1) * MiB],
                              source[i * MiB : (i + 1) * MiB])  # fmt: skip
