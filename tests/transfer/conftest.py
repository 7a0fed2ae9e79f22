"""Fixtures of the transfer tests: the suite's real redis-server, a segment directory with a
per-test key prefix, local engines, and peer engines in child processes."""

from __future__ import annotations

import secrets
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

sys.path.insert(0, str(Path(__file__).parent))  # transfer_helpers, for fixtures and the peer script

from transfer_helpers import PeerProcess  # noqa: E402
from yutu.transfer import SegmentDirectory, TransferEngine, sweep_stale_region_files  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def transfer_redis_url(redis_url: str) -> Iterator[str]:
    """The suite's redis-server (tests/conftest.py); region files of killed peers are swept after."""
    yield redis_url
    sweep_stale_region_files()


@pytest.fixture
def prefix() -> str:
    return f"t{secrets.token_hex(4)}"


@pytest.fixture
async def directory(transfer_redis_url: str, prefix: str) -> AsyncIterator[SegmentDirectory]:
    client = aioredis.Redis.from_url(transfer_redis_url)
    yield SegmentDirectory(client, prefix=prefix)
    await client.aclose()


@pytest.fixture
async def make_engine(directory: SegmentDirectory) -> AsyncIterator[Callable[..., TransferEngine]]:
    """Build engines (not started) in this process; all are closed at teardown."""
    engines: list[TransferEngine] = []

    def make(name: str, **kwargs: object) -> TransferEngine:
        engine = TransferEngine(name, directory, **kwargs)  # type: ignore[arg-type]
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.close()


@pytest.fixture
def spawn_peer(transfer_redis_url: str, prefix: str) -> Iterator[Callable[..., PeerProcess]]:
    """Start peer engines in child processes; all are stopped at teardown."""
    peers: list[PeerProcess] = []

    def spawn(
        segment: str, regions: list[str], transports: str = "shm,tcp", ttl_s: float = 10.0
    ) -> PeerProcess:
        peer = PeerProcess(transfer_redis_url, prefix, segment, regions, transports, ttl_s)
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.quit()
    sweep_stale_region_files()
