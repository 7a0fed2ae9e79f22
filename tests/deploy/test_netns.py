"""Two hosts in one machine: a store node (with Redis and the master) in one network namespace, a
client in another, joined by a veth pair; bytes move between them over TCP.

Namespace A runs Redis, the store master and a store node, each bound to 0.0.0.0 with no
--advertise-host: the services must advertise A's address on the veth (its default route), or the
client in B could not dial them. Both sides use TCP only (the namespaces share /dev/shm and the
host id, so the shared-memory transport would otherwise be chosen and prove nothing).
Needs root and iproute2; skipped with the reason when `ip netns` is not permitted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.231.{}.{}"  # 10.231.<tag>.1 is A, .2 is B
ADMIN = {"master": 9001, "node": 9002}
REDIS_PORT = 6399


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


@dataclass
class Namespaces:
    """Namespaces ``a`` and ``b`` joined by a veth pair: ``a_addr`` in A, ``b_addr`` in B, each
    side's default route through the other."""

    a: str
    b: str
    a_addr: str
    b_addr: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, ns: str, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=out, stderr=subprocess.STDOUT,
                                    cwd=ROOT, env=env, start_new_session=True)  # fmt: skip
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)


def netns_permitted() -> str | None:
    """None when this process may create network namespaces, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"yutu-probe-{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    reason = netns_permitted()
    if reason is not None:
        pytest.skip(reason)
    tag = os.getpid() % 250 + 1
    ns = Namespaces(
        f"yutu-a-{os.getpid()}", f"yutu-b-{os.getpid()}", SUBNET.format(tag, 1), SUBNET.format(tag, 2)
    )
    veth_a, veth_b = f"yva{os.getpid()}"[:15], f"yvb{os.getpid()}"[:15]
    try:
        ip("netns", "add", ns.a)
        ip("netns", "add", ns.b)
        ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        ip("link", "set", veth_a, "netns", ns.a)
        ip("link", "set", veth_b, "netns", ns.b)
        for name, veth, mine, peer in (
            (ns.a, veth_a, ns.a_addr, ns.b_addr),
            (ns.b, veth_b, ns.b_addr, ns.a_addr),
        ):
            ip("-n", name, "addr", "add", f"{mine}/24", "dev", veth)
            ip("-n", name, "link", "set", "lo", "up")
            ip("-n", name, "link", "set", veth, "up")
            ip("-n", name, "route", "add", "default", "via", peer)
        yield ns
    finally:
        ns.stop_all()
        for name in (ns.a, ns.b):  # deleting a namespace deletes its end of the veth, and so the pair
            ip("netns", "del", name, check=False)
        left = ip("netns", "list", check=False).stdout
        assert ns.a not in left and ns.b not in left, f"namespaces left behind: {left}"


CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys, time
    import httpx, redis.asyncio as aioredis
    from yutu.store.client import StoreClient, StoreClientConfig
    from yutu.transfer.directory import SegmentDirectory

    a_addr, redis_port, master_admin, node_admin = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

    def wait_ready(port):
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://{a_addr}:{port}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{a_addr}:{port}/ready never answered 200")
            time.sleep(0.1)

    async def main():
        wait_ready(master_admin)
        wait_ready(node_admin)
        url = f"redis://{a_addr}:{redis_port}/0"
        r = aioredis.from_url(url)
        desc = await SegmentDirectory(r, "netns").lookup("node-a")
        await r.aclose()
        payload = bytes((i * 131 + 7) % 251 for i in range(3 << 20))  # 3 MiB: several TCP slices
        config = StoreClientConfig(url, prefix="netns", transports=("tcp",), rpc_timeout_s=20,
                                   transfer_timeout_s=60)
        async with StoreClient(config) as store:
            await store.put("netns-object", payload)
            back = await store.get("netns-object")
        print(json.dumps({"tcp_host": desc.tcp_host, "same": back == payload, "size": len(back)}))

    asyncio.run(main())
    """
)


def test_store_node_in_one_namespace_serves_a_client_in_another_over_tcp(
    namespaces: Namespaces, tmp_path: Path
) -> None:
    ns = namespaces
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.skip("redis-server is not installed (scripts/bootstrap.sh --need-redis-binary installs it)")
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}", "OMP_NUM_THREADS": "1",
           "YUTU_SHM_DIR": str(shm_dir)}  # fmt: skip
    env.pop("YUTU_ADVERTISE_HOST", None)
    redis_url = f"redis://127.0.0.1:{REDIS_PORT}/0"  # A's own Redis, seen from inside A
    common = ["--redis-url", redis_url, "--registry-prefix", "netns", "--host", "0.0.0.0"]
    ns.spawn(ns.a, [redis_server, "--port", str(REDIS_PORT), "--bind", "0.0.0.0", "--protected-mode", "no",
                    "--save", "", "--appendonly", "no"], tmp_path / "redis.log", env)  # fmt: skip
    ns.spawn(ns.a, [sys.executable, "-m", "services.store_master.main", *common, "--instance-id", "master-a",
                    "--admin-port", str(ADMIN["master"]), "--no-persist"], tmp_path / "master.log", env)  # fmt: skip
    ns.spawn(ns.a, [sys.executable, "-m", "services.store_node.main", *common, "--instance-id", "node-a",
                    "--segment-name", "node-a", "--segment-size", "16MiB", "--transports", "tcp",
                    "--admin-port", str(ADMIN["node"])], tmp_path / "node.log", env)  # fmt: skip
    client = subprocess.run(
        ["ip", "netns", "exec", ns.b, sys.executable, "-c", CLIENT, ns.a_addr, str(REDIS_PORT),
         str(ADMIN["master"]), str(ADMIN["node"])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log")))
    assert client.returncode == 0, f"client in {ns.b} failed:\n{client.stderr[-3000:]}\n{logs}"
    result = json.loads(client.stdout.strip().splitlines()[-1])
    # the node bound 0.0.0.0 with no --advertise-host, and advertised A's veth address (not 127.0.0.1)
    assert result == {"tcp_host": ns.a_addr, "same": True, "size": 3 << 20}
