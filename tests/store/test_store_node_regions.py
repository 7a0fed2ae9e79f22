"""Shared memory of store nodes never outlives them: the stale-region rule, and a SIGKILLed node's
region reclaimed when the next node starts on the host."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from yutu.errors import YutuError
from yutu.store.client import StoreClient, StoreClientConfig
from yutu.transfer import Region
from yutu.transfer.region import (
    SHM_DIR_ENV,
    TMP_GRACE_S,
    reclaim_stale_regions,
    shm_directory,
    sweep_stale_region_files,
)

from tests.store.conftest import Cluster


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def region_file(directory: Path, pid: int, size: int = 4096, tmp: bool = False) -> Path:
    name = f"yutu-region-{pid}-{secrets.token_hex(6)}-{size}"
    path = directory / (f".{name}.tmp" if tmp else name)
    path.write_bytes(b"\0" * size)
    return path


def test_a_dead_owners_file_goes_a_locked_one_stays_whatever_its_pid(tmp_path: Path) -> None:
    gone = dead_pid()
    stale = region_file(tmp_path, gone)
    # A live owner whose pid we cannot see (another pid namespace) or whose pid was reused: the
    # pid in the name is dead here, but the owner holds the lock.
    foreign = region_file(tmp_path, gone)
    holder = os.open(foreign, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    live = Region.create("live", 8192, shm_dir=str(tmp_path))  # our own: alive and locked
    try:
        assert reclaim_stale_regions(str(tmp_path)) == (1, 4096)
        assert not stale.exists()
        assert foreign.exists() and os.path.exists(live.path)
        os.close(holder)  # the foreign owner dies: the kernel drops its lock
        holder = -1
        assert sweep_stale_region_files(str(tmp_path)) == [str(foreign)]
        assert os.path.exists(live.path)
    finally:
        if holder >= 0:
            os.close(holder)
        live.close()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_temporary_file_is_only_removed_once_its_creator_cannot_still_be_renaming_it(
    tmp_path: Path,
) -> None:
    young = region_file(tmp_path, dead_pid(), tmp=True)
    old = region_file(tmp_path, dead_pid(), tmp=True)
    past = time.time() - TMP_GRACE_S - 5
    os.utime(old, (past, past))
    assert sweep_stale_region_files(str(tmp_path)) == [str(old)]
    assert young.exists()


def test_a_region_is_locked_by_its_owner_from_before_it_has_its_name(tmp_path: Path) -> None:
    with Region.create("kv", 4096, shm_dir=str(tmp_path)) as region:
        assert os.listdir(tmp_path) == [os.path.basename(region.path)]  # no temporary file left
        probe = os.open(region.path, os.O_RDONLY)
        try:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("the owner does not hold the region's lock")
            except BlockingIOError:
                pass
        finally:
            os.close(probe)
    assert os.listdir(tmp_path) == []


@pytest.fixture
def private_shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A region directory (tmpfs) for the processes this test starts, that no other sweep on the
    host touches: other sessions' services sweep /dev/shm when they start."""
    path = Path(tempfile.mkdtemp(prefix="yutu-test-", dir=shm_directory()))
    monkeypatch.setenv(SHM_DIR_ENV, str(path))
    try:
        yield path
    finally:
        shutil.rmtree(path)


async def test_a_sigkilled_nodes_region_is_reclaimed_when_the_next_node_starts(
    private_shm: Path, store_cluster: Cluster
) -> None:
    def node_region_files(pid: int) -> list[str]:
        return sorted(f for f in os.listdir(private_shm) if f.startswith(f"yutu-region-{pid}-"))

    store_cluster.master()
    node = store_cluster.node("n0", size="8MiB")
    files = node_region_files(node.popen.pid)
    assert len(files) == 1 and files[0].endswith("-8388608")
    node.kill()
    assert node_region_files(node.popen.pid) == files  # SIGKILL: nobody unlinked it
    fresh = store_cluster.restart(node)
    assert node_region_files(node.popen.pid) == []
    assert len(node_region_files(fresh.popen.pid)) == 1
    log = fresh.log.read_text()
    assert "reclaimed 1 shared-memory region file(s) of dead processes (8 MiB)" in log
    assert files[0] in log
    fresh.stop()
    assert node_region_files(fresh.popen.pid) == []  # SIGTERM: the node unlinked its own


async def test_a_store_client_that_cannot_start_leaves_no_shared_memory(
    private_shm: Path, redis_url: str, registry_prefix: str
) -> None:
    client = StoreClient(StoreClientConfig(redis_url, prefix=registry_prefix, staging_bytes=1 << 20))
    with pytest.raises(YutuError, match="no store master is registered"):
        async with client:  # no master under this prefix: start() fails after taking its staging region
            raise AssertionError("started without a master")
    assert os.listdir(private_shm) == []
    assert client.engine is not None and client.engine.regions == {}
