"""`yutu up` supervises its children: a crashed store node or Redis is restarted while requests keep
being served, the gateway's death stops the stack, and a terminal's Ctrl-C stops it cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from yutu.engine.testing import make_tiny_checkpoint
from yutu.launcher import free_port, redis_reachable
from yutu.store.client import StoreClient, StoreClientConfig
from yutu.transfer.region import SHM_DIR_ENV, shm_directory


class Up:
    """`yutu up` in its own session (as a terminal runs it), HOME in ``tmp_path``, output collected."""

    def __init__(self, tmp_path: Path, shm: Path, *flags: str) -> None:
        self.checkpoint = make_tiny_checkpoint(tmp_path / "tiny-sup", arch="llama", seed=7)
        self.port = free_port()
        self.redis_url = f"redis://127.0.0.1:{free_port()}/0"
        assert not redis_reachable(self.redis_url)
        self.home = tmp_path / "home"
        argv = [sys.executable, "-m", "yutu.cli", "up", "--model", str(self.checkpoint), "--port", str(self.port),
                "--redis-url", self.redis_url, "--kv-cache-memory-mib", "64", "--store-segment-size", "16MiB",
                *flags]  # fmt: skip
        self.shm = shm  # where the stack's region files live (YUTU_SHM_DIR)
        env = {**os.environ, "HOME": str(self.home), "OMP_NUM_THREADS": "1", SHM_DIR_ENV: str(shm)}
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._out = b""
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for chunk in iter(lambda: self.proc.stdout.read1(65536), b""):  # type: ignore[union-attr]
            with self._lock:
                self._out += chunk

    @property
    def output(self) -> str:
        with self._lock:
            return self._out.decode(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        """The first match of the regex ``pattern`` in the output, waiting for it."""
        deadline = time.monotonic() + timeout_s
        while (match := re.search(pattern, self.output)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"`yutu up` did not print {pattern!r}; output:\n{self.output}")
            time.sleep(0.1)
        return match

    def children(self) -> list[int]:
        found: list[int] = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
        return found

    def pid_of(self, name: str) -> int:
        """The pid of the child named ``name`` ("redis" or a service's instance id)."""
        for pid in self.children():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if (name == "redis" and b"redis-server" in cmdline[0]) or name.encode() in cmdline:
                return pid
        raise AssertionError(f"no child {name!r} of `yutu up` ({self.children()})")

    def region_files(self, pid: int) -> list[str]:
        return sorted(f for f in os.listdir(self.shm) if f.startswith(f"yutu-region-{pid}-"))

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


@pytest.fixture
def shm() -> Iterator[Path]:
    """A region directory (tmpfs) of the test's own: other sessions' services sweep /dev/shm."""
    path = Path(tempfile.mkdtemp(prefix="yutu-test-", dir=shm_directory()))
    try:
        yield path
    finally:
        shutil.rmtree(path)


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


class Load:
    """Completions sent one after another through the gateway until stopped; every failure is kept."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.served = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "hello there", "max_tokens": 2, "temperature": 0}
        with httpx.Client(timeout=30.0) as http:
            while not self._stop.is_set():
                try:
                    resp = http.post(f"{self.url}/v1/completions", json=body)
                    if resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2:
                        self.served += 1
                    else:
                        self.failures.append(f"{resp.status_code}: {resp.text}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))

    def wait_served(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.served < count:
            assert time.monotonic() < deadline, (
                f"only {self.served} requests served; failures {self.failures}"
            )
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


async def store_roundtrip(redis_url: str, payloads: dict[str, bytes]) -> list[bytes]:
    async with StoreClient(StoreClientConfig(redis_url, staging_bytes=8 << 20)) as store:
        assert await store.put_batch(payloads, upsert=True) == [True] * len(payloads)
        return await store.get_batch(list(payloads))


@pytest.mark.timeout(600)
def test_crashed_children_are_restarted_under_load_and_the_gateways_death_stops_the_stack(
    tmp_path: Path, shm: Path
) -> None:
    up = Up(tmp_path, shm, "--log-dir", str(tmp_path / "logs"))
    load: Load | None = None
    try:
        up.wait_for("Ctrl-C stops everything", timeout_s=240)
        load = Load(f"http://127.0.0.1:{up.port}", "tiny-sup")
        load.wait_served(3)

        node = up.pid_of("store-node-0")
        [node_file] = up.region_files(node)
        os.kill(node, signal.SIGKILL)
        up.wait_for(
            rf"store-node-0 \(pid {node}\) was killed by SIGKILL after [\d.]+s; restarting it in 0\.5s"
        )
        new_node = int(up.wait_for(r"restarted store-node-0: pid (\d+)").group(1))
        up.wait_for(rf"store-node-0 \(pid {new_node}\) is ready again")
        assert new_node != node and up.pid_of("store-node-0") == new_node
        assert up.region_files(node) == []  # the killed node's shared memory was reclaimed
        assert node_file in (tmp_path / "logs" / "store-node-0.log").read_text()  # ... by its successor
        payloads = {f"sup-{i}": os.urandom(50_000) for i in range(4)}
        assert asyncio.run(store_roundtrip(up.redis_url, payloads)) == list(payloads.values())

        server = up.pid_of("redis")
        with redis.Redis.from_url(up.redis_url) as client:  # append-only, in HOME's cache, per port
            config = client.config_get("*")
        assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"
        assert config["dir"] == str(up.home / ".cache" / "yutu" / "redis" / up.redis_url.split(":")[2][:-2])
        os.kill(server, signal.SIGKILL)
        up.wait_for(rf"redis \(pid {server}\) was killed by SIGKILL after [\d.]+s; restarting it in 0\.5s")
        new_server = int(up.wait_for(r"restarted redis: pid (\d+)").group(1))
        assert new_server != server
        deadline = time.monotonic() + 30
        while not redis_reachable(up.redis_url):
            assert time.monotonic() < deadline, "the restarted Redis does not answer"
            time.sleep(0.1)
        served = load.served
        load.wait_served(served + 5)
        assert asyncio.run(store_roundtrip(up.redis_url, payloads)) == list(payloads.values())
        load.stop()
        assert load.failures == []

        # The only decode instance, killed mid-stream: the stream waits for its restart and goes on.
        body = {"model": "tiny-sup", "prompt": "hello there", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        decode = up.pid_of("decode-0")
        streamed, events = 0, []
        with httpx.stream(
            "POST", f"http://127.0.0.1:{up.port}/v1/completions", json=body, timeout=90
        ) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[len("data: ") :]))
                    streamed += sum(
                        1 for c in events[-1].get("choices", []) if c["text"] or c["finish_reason"]
                    )
                if streamed == 20:
                    os.kill(decode, signal.SIGKILL)
        assert not [e for e in events if "error" in e], [e for e in events if "error" in e]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        up.wait_for(r"restarted decode-0: pid (\d+)")
        assert up.region_files(decode) != []  # its KV region is left until someone sweeps

        children = up.children()
        gateway = up.pid_of("gateway")
        os.kill(gateway, signal.SIGKILL)
        assert up.proc.wait(timeout=90) == 1
        message = up.wait_for(
            rf"gateway \(pid {gateway}\) was killed by SIGKILL after [\d.]+s; it is not restarted, so the "
            r"stack stops; last lines of its log \(.*gateway\.log\):"
        )
        assert "ERROR" in up.output[: message.start()].rsplit("\n", 1)[-1]
        assert "restarted gateway" not in up.output
        assert not [pid for pid in children if alive(pid)]
        assert os.listdir(shm) == []  # the killed decode's region too: swept once the children stopped
    finally:
        if load is not None:
            load.stop()
        up.close()


@pytest.mark.timeout(300)
def test_ctrl_c_from_the_terminal_stops_everything_cleanly(tmp_path: Path, shm: Path) -> None:
    up = Up(tmp_path, shm)  # no --log-dir: every child's output comes through the same terminal
    try:
        up.wait_for("Ctrl-C stops everything", timeout_s=240)
        children = up.children()
        # redis-server, store-master, store-node-0, conductor, prefill-0, decode-0, gateway
        assert len(children) == 7
        node = up.pid_of("store-node-0")
        assert len(up.region_files(node)) == 1
        redis_pid = up.pid_of("redis")
        assert os.getpgid(redis_pid) != up.proc.pid  # Redis is out of the terminal's reach
        os.killpg(up.proc.pid, signal.SIGINT)  # what Ctrl-C does: SIGINT to the foreground group
        assert up.proc.wait(timeout=20) == 0
        up.wait_for("yutu up: stopping")
        up._reader.join(timeout=10)
        assert "Traceback" not in up.output
        assert os.listdir(shm) == []  # no region file left, of any process
        assert group_members(up.proc.pid) == []
        assert not [pid for pid in children if alive(pid)]
        assert not redis_reachable(up.redis_url)  # stopped last, by `yutu up`
    finally:
        up.close()
