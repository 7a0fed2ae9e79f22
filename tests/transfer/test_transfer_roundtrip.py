"""Byte-exact READ and WRITE between two processes over TCP and over SHM, 1 B to 64 MiB."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from functools import lru_cache

import numpy as np
import pytest
from transfer_helpers import PeerProcess, digest, pattern
from yutu.transfer import TransferEngine, TransferOp, TransferRequest, TransferStatus

MiB = 1 << 20
REGION = 80 * MiB
SIZES = [1, 7, 4096, 65537, MiB + 3, 4 * MiB + 1, 9 * MiB + 7, 64 * MiB]
SOURCE_SEED = 11  # peer region "source": only ever read
SINK_SEED = 12  # peer region "sink": written by the WRITE tests


@lru_cache(maxsize=2)
def expected(seed: int) -> np.ndarray:
    return pattern(seed, REGION)


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"rt{secrets.token_hex(4)}"


@pytest.fixture(scope="module")
def peer(transfer_redis_url: str, prefix: str) -> Iterator[PeerProcess]:
    proc = PeerProcess(
        transfer_redis_url,
        prefix,
        "rt-peer",
        [f"source:{REGION}:{SOURCE_SEED}", f"sink:{REGION}:{SINK_SEED}"],
    )
    yield proc
    proc.quit()


async def started(make_engine: Callable[..., TransferEngine], transport: str) -> TransferEngine:
    engine = make_engine(f"rt-client-{transport}", transports=(transport,))
    engine.register_region("buf", REGION)
    await engine.start()
    return engine


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("size", SIZES)
async def test_read_round_trip(
    peer: PeerProcess, make_engine: Callable[..., TransferEngine], transport: str, size: int
) -> None:
    engine = await started(make_engine, transport)
    local = engine.regions["buf"].view_numpy()
    local_off, remote_off = 3, 4099  # unaligned on purpose
    req = TransferRequest(TransferOp.READ, "buf", local_off, "rt-peer", "source", remote_off, size)
    [result] = await engine.transfer([req])
    assert result.status is TransferStatus.COMPLETED, result.error
    assert result.transport == transport
    want = expected(SOURCE_SEED)[remote_off : remote_off + size]
    assert np.array_equal(local[local_off : local_off + size], want)
    # bytes around the target range are untouched
    assert not local[:local_off].any()
    assert not local[local_off + size : local_off + size + 4096].any()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("size", SIZES)
async def test_write_round_trip(
    peer: PeerProcess, make_engine: Callable[..., TransferEngine], transport: str, size: int
) -> None:
    engine = await started(make_engine, transport)
    local = engine.regions["buf"].view_numpy()
    local[:] = pattern(1000 + size, REGION)
    local_off, remote_off = 5, 1001
    await peer.afill("sink", SINK_SEED)
    req = TransferRequest(TransferOp.WRITE, "buf", local_off, "rt-peer", "sink", remote_off, size)
    [result] = await engine.transfer([req])
    assert result.status is TransferStatus.COMPLETED, result.error
    assert result.transport == transport
    assert await peer.adigest("sink", remote_off, size) == digest(local[local_off : local_off + size])
    # the peer's bytes around the written range are unchanged
    sink = expected(SINK_SEED)
    assert await peer.adigest("sink", 0, remote_off) == digest(sink[:remote_off])
    end = remote_off + size
    assert await peer.adigest("sink", end, 4096) == digest(sink[end : end + 4096])
