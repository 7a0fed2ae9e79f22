"""Store fixtures: a store master and store nodes as real subprocesses on loopback, real Redis.

``store_cluster`` is a factory: ``cluster.master()``, ``cluster.node("n0")``, ``cluster.client()``;
everything it started is stopped at the end of the test (SIGKILL after a grace period), whatever
happened. Short TTLs keep liveness and lease tests fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from yutu.launcher import free_port
from yutu.store.client import StoreClient, StoreClientConfig
from yutu.transfer import sweep_stale_region_files

ROOT = Path(__file__).resolve().parents[2]

FAST_MASTER = {
    "--lease-ttl": "1.0",
    "--put-timeout": "3.0",
    "--node-ttl": "1.5",
    "--sweep-interval": "0.1",
    "--registry-ttl": "3.0",
}
FAST_NODE = {"--heartbeat-interval": "0.3", "--registry-ttl": "3.0"}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    admin: str
    log: Path
    args: list[str]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: no goodbye to the master, no cleanup."""
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self, timeout: float = 10.0) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return int(self.popen.returncode)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.admin + path, timeout=5.0)

    def post(self, path: str) -> httpx.Response:
        return httpx.post(self.admin + path, timeout=5.0)


@dataclass
class Cluster:
    redis_url: str
    prefix: str
    workdir: Path
    procs: list[Proc] = field(default_factory=list)
    clients: list[StoreClient] = field(default_factory=list)
    master_port: int = field(default_factory=free_port)

    def _spawn(self, name: str, module: str, flags: dict[str, str], extra: list[str]) -> Proc:
        admin_port = free_port()
        args = [
            sys.executable, "-m", module, "--redis-url", self.redis_url, "--registry-prefix", self.prefix,
            "--admin-port", str(admin_port), "--instance-id", name, "--log-level", "info",
        ]  # fmt: skip
        for flag, value in flags.items():
            args += [flag] if value == "" else [flag, value]
        args += extra
        log = self.workdir / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}", "OMP_NUM_THREADS": "1"}
        with open(log, "ab") as out:
            popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        proc = Proc(name, popen, f"http://127.0.0.1:{admin_port}", log, args)
        self.procs.append(proc)
        self.wait_ready(proc)
        return proc

    def wait_ready(self, proc: Proc, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise AssertionError(
                    f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log.read_text()[-3000:]}"
                )
            try:
                if proc.get("/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"{proc.name} not ready after {timeout}s:\n{proc.log.read_text()[-3000:]}")

    def master(self, name: str = "master", **flags: str) -> Proc:
        merged = {**FAST_MASTER, "--port": str(self.master_port), **{_flag(k): v for k, v in flags.items()}}
        return self._spawn(name, "services.store_master.main", merged, [])

    def node(self, name: str, size: str = "16MiB", **flags: str) -> Proc:
        merged = {**FAST_NODE, "--segment-size": size, **{_flag(k): v for k, v in flags.items()}}
        return self._spawn(name, "services.store_node.main", merged, [])

    def restart(self, proc: Proc) -> Proc:
        """Start ``proc`` again with the same arguments (after it was stopped or killed)."""
        log = proc.log
        with open(log, "ab") as out:
            popen = subprocess.Popen(proc.args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}"})  # fmt: skip
        fresh = Proc(proc.name, popen, proc.admin, log, proc.args)
        self.procs.append(fresh)
        self.wait_ready(fresh)
        return fresh

    async def client(self, **overrides: object) -> StoreClient:
        settings: dict[str, object] = {
            "staging_bytes": 8 << 20, "rpc_timeout_s": 5.0, "transfer_timeout_s": 5.0, **overrides,
        }  # fmt: skip
        config = StoreClientConfig(redis_url=self.redis_url, prefix=self.prefix, **settings)  # type: ignore[arg-type]
        client = StoreClient(config)
        await client.start()
        self.clients.append(client)
        return client

    def wait_for(self, predicate: object, timeout: float = 10.0, what: str = "condition") -> None:
        assert callable(predicate)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def stats(self, master: Proc) -> dict[str, object]:
        return dict(master.get("/stats").json())


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


async def stop_cluster(cluster: Cluster) -> None:
    """Close the clients, stop every process the cluster started, sweep what SIGKILLs left."""
    for client in cluster.clients:
        try:
            await client.close()
        except Exception:  # noqa: BLE001 - a failed test may leave a client half-closed
            pass
    # nodes first, while the master can still take their unmount; then the masters
    for proc in sorted(reversed(cluster.procs), key=lambda p: "store_master" in " ".join(p.args)):
        proc.stop(timeout=5.0)
    sweep_stale_region_files()  # shared memory left by nodes the test SIGKILLed


@pytest.fixture
async def store_cluster(redis_url: str, registry_prefix: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(redis_url, registry_prefix, tmp_path)
    try:
        yield cluster
    finally:
        await stop_cluster(cluster)
