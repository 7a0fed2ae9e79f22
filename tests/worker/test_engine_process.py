"""The engine core in its own process: its death breaks the worker (which says why and stays up),
and the worker's end is the engine process's end, on every path, with no shared memory left."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from worker_support import Dealer
from yutu.engine.testing import make_tiny_checkpoint
from yutu.protocol.generate import GenerateRequest, RequestFailed, TokenDelta
from yutu.registry import Registry
from yutu.transfer.region import FILE_PREFIX, shm_directory, sweep_stale_region_files

PROMPT = [5, 9, 23, 42, 7, 7, 81, 3, 64, 11, 2, 19, 33, 48, 90, 101, 17, 4]
LONG = {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", arch="llama", seed=5)


class Worker:
    def __init__(self, checkpoint: Path, redis_url: str, name: str) -> None:
        self.prefix, self.name, self.redis_url = f"yutu-engine-proc-{name}", name, redis_url
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.worker.main", "--model", str(checkpoint), "--redis-url", redis_url,
             "--registry-prefix", self.prefix, "--instance-id", name, "--num-kv-blocks", "128",
             "--block-size", "4", "--torch-threads", "1", "--log-level", "warning"],
        )  # fmt: skip
        self.endpoints = asyncio.run(self._registered())
        self.info = httpx.get(self.endpoints["admin"] + "/info", timeout=10).json()
        self.engine_pid: int = self.info["engine_pid"]

    async def _registered(self) -> dict[str, str]:
        registry = Registry.from_url(self.redis_url, self.prefix)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, "worker exited during start-up"
                record = await registry.get("worker", self.name)
                if record is not None:
                    return record.endpoints
                await asyncio.sleep(0.2)
        finally:
            await registry.close()
        raise TimeoutError("worker did not register")

    def regions(self) -> list[str]:
        return glob.glob(os.path.join(shm_directory(), f"{FILE_PREFIX}-{self.proc.pid}-*"))

    def close(self) -> None:
        """SIGTERM (the worker removes its region file), SIGKILL if it hangs; then sweep what a
        killed worker left."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        sweep_stale_region_files()


@pytest.fixture
def worker(checkpoint: Path, redis_url: str, request: pytest.FixtureRequest) -> Iterator[Worker]:
    w = Worker(checkpoint, redis_url, request.node.name[-20:].strip("_[]") or "w")
    try:
        yield w
    finally:
        w.close()


def _gone(pid: int, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie child of ours counts as gone once reaped by its parent; check its state
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


async def _next(sock: Dealer) -> TokenDelta | RequestFailed:
    msg = await sock.recv(60)
    assert isinstance(msg, TokenDelta | RequestFailed)
    return msg


async def test_a_killed_engine_process_breaks_the_worker_which_stays_up_and_says_why(worker: Worker) -> None:
    assert worker.info["engine_core"] == "process" and worker.engine_pid != worker.proc.pid
    assert worker.regions(), "the KV cache region is the worker's (its transfer engine serves it)"
    sock = Dealer(worker.endpoints["generate"])
    try:
        sock.send(GenerateRequest("long", PROMPT * 3, LONG, time.time()))
        first = await _next(sock)
        assert isinstance(first, TokenDelta) and first.token_ids

        os.kill(worker.engine_pid, signal.SIGKILL)
        while True:  # deltas already sent, then the in-flight request fails
            msg = await _next(sock)
            if isinstance(msg, RequestFailed):
                break
            assert msg.finish_reason is None
        assert msg.request_id == "long" and msg.kind == "internal_error"
        assert "the engine process ended (killed by SIGKILL)" in msg.message

        async with httpx.AsyncClient() as http:
            ready = await http.get(worker.endpoints["admin"] + "/ready")
            assert ready.status_code == 503
            assert "engine broken: the engine process ended (killed by SIGKILL)" in ready.text
            assert (await http.get(worker.endpoints["admin"] + "/health")).status_code == 200
            check = await http.post(worker.endpoints["admin"] + "/debug/check_integrity")
            assert check.status_code == 503 and "the engine is not running" in check.text

        sock.send(GenerateRequest("late", PROMPT, LONG, time.time()))
        late = await _next(sock)
        assert isinstance(late, RequestFailed) and late.request_id == "late"
        assert late.kind == "service_unavailable" and "retry on another worker" in late.message
    finally:
        sock.close()
    assert worker.proc.poll() is None  # the worker lives on to say why
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(timeout=30) == 1  # it ended, but its engine had died under it
    assert worker.regions() == []


def test_sigterm_stops_the_engine_process_and_removes_the_region(worker: Worker) -> None:
    assert worker.regions()
    # The engine's socket folder lives only until the engine connects: a SIGKILL later leaks nothing.
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"yutu-engine-{worker.proc.pid}-*")) == []
    os.kill(worker.engine_pid, signal.SIGTERM)  # as a SIGTERM to the whole group would: the
    os.kill(worker.engine_pid, signal.SIGINT)  # worker decides when its engine stops
    time.sleep(0.5)
    assert not _gone(worker.engine_pid, timeout_s=0.5)
    ready = httpx.get(worker.endpoints["admin"] + "/ready", timeout=10)
    assert ready.status_code == 200, ready.text
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(timeout=30) == 0
    assert _gone(worker.engine_pid)
    assert worker.regions() == []


def test_the_engine_process_names_itself_and_spins_its_threads_briefly(worker: Worker) -> None:
    """Other engines' wide steps find it by name (yutu.engine.cpus), and torch's OpenMP threads stop
    spinning soon after a parallel region (OMP_SPIN_COUNT) unless the environment says otherwise."""
    from yutu.engine.cpus import ENGINE_NAME, engine_processes

    from services.worker.engine_process import OMP_SPIN_COUNT

    with open(f"/proc/{worker.engine_pid}/comm", "rb") as f:
        assert f.read().strip() == ENGINE_NAME
    assert worker.engine_pid in engine_processes()
    with open(f"/proc/{worker.engine_pid}/environ", "rb") as f:
        environ = dict(v.partition(b"=")[::2] for v in f.read().split(b"\0") if v)
    assert environ[b"GOMP_SPINCOUNT"] == str(os.environ.get("GOMP_SPINCOUNT", OMP_SPIN_COUNT)).encode()


def test_a_killed_worker_takes_its_engine_process_along(worker: Worker) -> None:
    worker.proc.kill()
    worker.proc.wait()
    assert _gone(worker.engine_pid), "the engine process outlived its worker"
    for path in worker.regions():  # a SIGKILLed worker cannot unlink; the next start would reclaim it
        os.unlink(path)
