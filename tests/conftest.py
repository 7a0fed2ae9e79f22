"""Fixtures shared by the whole suite: a real redis-server on a free loopback port."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from yutu.launcher import free_port


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a redis-server started for this test session (never the user's Redis)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server not found: run `make test` (it installs it) or `apt-get install redis-server`"
        )
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"redis-server did not start on port {port}")
            time.sleep(0.05)
    client.close()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def registry_prefix() -> str:
    """A key prefix no other test uses, so tests sharing the Redis never see each other's records."""
    return f"yutu-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads() -> None:
    # Two cores are shared by the test process and the services it starts: keep torch to one thread.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
