"""Helpers of the gateway tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from yutu.protocol.generate import CHANNEL, AbortRequest, GenerateRequest, Ping, Pong
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.rpc import Sent, StreamPeer
from yutu.service import HttpServer

from services.gateway.app import build_app
from services.gateway.service import GatewayService
from services.gateway.settings import GatewaySettings

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
BLOCK_SIZE = 16  # of the real workers the tests start
MAX_MODEL_LEN = 256

# -- scripted worker ------------------------------------------------------------------------------


class FakeWorker:
    """A worker whose replies the test writes; see the module docstring."""

    def __init__(self, redis_url: str, prefix: str, max_model_len: int = 128, demo: bool = False) -> None:
        """Built inside a running event loop (its router serves on it)."""
        self.instance_id = f"fake-{uuid.uuid4().hex[:6]}"
        self.peer = StreamPeer.router(  # the real generate channel
            CHANNEL, {GenerateRequest: self._on_request, AbortRequest: self._on_abort, Ping: self._on_ping}
        )
        self.registry = Registry.from_url(redis_url, prefix)
        self.record = ServiceRecord(
            kind="worker",
            instance_id=self.instance_id,
            endpoints={"generate": self.peer.endpoint, "admin": "http://127.0.0.1:1"},
            meta={"model": MODEL_NAME, "model_dir": "x", "max_model_len": max_model_len, "block_size": 16,
                  "demo": demo, "num_running": 0, "num_waiting": 0, "kv_usage": 0.0},
        )  # fmt: skip
        self.registration = Registration(self.registry, self.record, ttl_s=30)
        self.requests: asyncio.Queue[tuple[bytes, GenerateRequest]] = asyncio.Queue()
        self.aborts: list[str] = []
        self._abort_seen = asyncio.Event()
        self.answer_pings = True  # False: frozen, as far as the gateway's heartbeats can tell
        self.pings = 0

    async def start(self) -> FakeWorker:
        await self.registration.start()
        return self

    def _on_request(self, identity: bytes, msg: GenerateRequest) -> None:
        self.requests.put_nowait((identity, msg))

    def _on_abort(self, _: bytes, msg: AbortRequest) -> None:
        self.aborts.append(msg.request_id)
        self._abort_seen.set()

    def _on_ping(self, identity: bytes, msg: Ping) -> None:
        self.pings += 1
        if self.answer_pings:
            self.send_now(identity, Pong(msg.seq))

    async def next_request(self, timeout_s: float = 5.0) -> tuple[bytes, GenerateRequest]:
        return await asyncio.wait_for(self.requests.get(), timeout_s)

    def send_now(self, identity: bytes, msg: Any) -> Sent:
        return self.peer.send(msg, to=identity)

    async def send(self, identity: bytes, msg: Any) -> Sent:
        return self.send_now(identity, msg)

    async def wait_abort(self, request_id: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while request_id not in self.aborts:
            self._abort_seen.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no AbortRequest for {request_id}; aborts seen: {self.aborts}")
            try:
                await asyncio.wait_for(self._abort_seen.wait(), remaining)
            except TimeoutError:
                pass

    async def die(self) -> None:
        """Close the socket but leave the registry record: a crashed process whose record lives on."""
        self.peer.close()

    async def close(self) -> None:
        await self.die()
        await self.registration.close()
        await self.registry.close()


def gateway_settings(model: Path, redis_url: str, prefix: str, **overrides: Any) -> GatewaySettings:
    values: dict[str, Any] = dict(
        model=str(model),
        served_model_name=MODEL_NAME,
        host="127.0.0.1",
        port=0,
        advertise_host="127.0.0.1",
        api_keys=(),
        max_request_bytes=32 * 2**20,
        redis_url=redis_url,
        registry_prefix=prefix,
        registry_ttl_s=10.0,
        registry_poll_s=0.2,
        worker_liveness_timeout_s=3.0,
        instance_id=f"gw-{uuid.uuid4().hex[:6]}",
        log_level="warning",
    )
    values.update(overrides)
    return GatewaySettings(**values)


@asynccontextmanager
async def running_gateway(
    settings: GatewaySettings, connected_workers: int = 1
) -> AsyncIterator[tuple[str, GatewayService]]:
    """A gateway in this event loop, once ``connected_workers`` workers are live: (base URL, service)."""
    service = GatewayService(settings)
    http = HttpServer(build_app(service), settings.host, settings.port, settings.advertise_host)
    service.http_url = http.url  # as serve() does
    try:
        await service.startup()
        await http.start()
        for _ in range(100):
            if len(service.pool.live()) >= connected_workers:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"gateway did not connect to {connected_workers} worker(s)")
        yield f"http://127.0.0.1:{http.port}", service
    finally:
        await http.stop()
        await service.shutdown()


# -- the real stack -------------------------------------------------------------------------------


@dataclass
class Stack:
    base_url: str  # the gateway
    worker_admin: str
    redis_url: str
    prefix: str
    model_dir: Path
    logs: Path
    block_size: int
    max_model_len: int


def spawn(args: list[str], log_file: Path, **env_extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_extra}
    with log_file.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env
        )


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def start_worker(
    logs: Path, model: Path, redis_url: str, prefix: str, *extra: str
) -> subprocess.Popen[bytes]:
    """A real worker: 64 KV blocks of BLOCK_SIZE tokens, context MAX_MODEL_LEN, one torch thread,
    float32 (the tests hold its tokens and logprobs to the float32 reference). Its KV region's file
    goes to ``logs/shm``, not /dev/shm: a test that kills it leaves nothing in the machine's memory."""
    name = f"worker-{uuid.uuid4().hex[:6]}"
    shm = logs / "shm"
    shm.mkdir(exist_ok=True)
    return spawn(
        ["-m", "services.worker.main", "--model", str(model), "--served-model-name", MODEL_NAME,
         "--redis-url", redis_url, "--registry-prefix", prefix, "--admin-port", "0", "--zmq-port", "0",
         "--num-kv-blocks", "64", "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
         "--torch-threads", "1", "--dtype", "float32", "--instance-id", name, "--log-level", "info", *extra],
        logs / f"{name}.log",
        YUTU_SHM_DIR=str(shm),
    )  # fmt: skip


def start_gateway(
    stack_dir: Path, model: Path, redis_url: str, prefix: str, *extra: str
) -> subprocess.Popen[bytes]:
    name = f"gateway-{uuid.uuid4().hex[:6]}"
    return spawn(
        ["-m", "services.gateway.main", "--model", str(model), "--served-model-name", MODEL_NAME,
         "--redis-url", redis_url, "--registry-prefix", prefix, "--port", "0", "--registry-poll", "0.2",
         "--instance-id", name, "--log-level", "info", *extra],
        stack_dir / f"{name}.log",
    )  # fmt: skip


def gateway_url(redis_url: str, prefix: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> str:
    """The HTTP URL a gateway subprocess registered, once it answers /health."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}")
            for key in client.scan_iter(f"{prefix}:svc:gateway:*"):
                raw = client.get(key)
                if raw is None:
                    continue
                rec = json.loads(raw)
                if rec["pid"] == proc.pid:
                    url = rec["endpoints"]["http"]
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        return str(url)
            time.sleep(0.1)
    finally:
        client.close()
    raise RuntimeError("gateway did not register in time")


def wait_ready(url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"process {proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready in {timeout_s}s")


def worker_info(admin: str) -> dict[str, Any]:
    """A worker's ``/info`` (its engine's counters) from its admin URL."""
    info: dict[str, Any] = httpx.get(f"{admin}/info", timeout=10).json()
    return info


def wait_idle(admin: str, timeout_s: float = 15.0) -> dict[str, Any]:
    """The worker's ``/info`` once it runs and holds nothing; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = worker_info(admin)
        engine = info["engine"]
        if info["in_flight"] == 0 and engine["num_running"] == 0 and engine["num_waiting"] == 0:
            return info
        assert time.monotonic() < deadline, f"worker still busy: {info}"
        time.sleep(0.05)
