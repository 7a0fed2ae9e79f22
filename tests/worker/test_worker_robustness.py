"""The worker never dies of one request, and says so when its engine is truly broken.

- A real worker and gateway (subprocesses, real Redis): sampling parameters that used to make the
  sampler meet NaN or overflow (top_p=1e-50 is 0 in float32; top_k=2**63 does not fit int64) are
  refused with a 400 naming the field, the next requests are served, and the worker lives on.
- The broken-engine state machine (control logic, so a fake engine): failed steps fail their
  requests; ``max_failed_steps`` in a row, a step that raises, or a failure outside a step make the
  engine broken; a broken worker stays up, is not ready with the reason, writes ``broken`` into its
  registry meta (real Redis) and fails new requests with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio
import torch
from yutu.engine.engine import FinishReason, RequestOutput
from yutu.engine.errors import EngineBrokenError, RequestFailedError
from yutu.engine.loader import resolve_device
from yutu.engine.outputs import EngineStats
from yutu.engine.sampling import SamplingParams
from yutu.engine.testing import make_tiny_checkpoint
from yutu.errors import ErrorKind
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.service import admin_app
from yutu.transfer import SegmentDirectory, TransferEngine
from yutu.worker.kv_region import KVRegion

from services.worker.engine_core import EngineInfo
from services.worker.engine_loop import EngineLoop, EngineUnavailableError
from services.worker.generate_role import GenerateRole
from services.worker.service import WorkerService
from services.worker.settings import WorkerSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from gateway_support import (  # noqa: E402 - the gateway tests' helpers, imported from their folder
    MODEL_NAME,
    gateway_url,
    start_gateway,
    start_worker,
    stop_process,
    wait_ready,
)

torch.set_num_threads(1)

# -- a real worker behind a real gateway ----------------------------------------------------------


@dataclass
class RealStack:
    url: str
    worker_admin: str
    worker: Any  # subprocess.Popen


@pytest.fixture(scope="module")
def real_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealStack]:
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("robust-model") / "tiny", arch="llama", seed=0)
    prefix = f"yutu-robust-{uuid.uuid4().hex[:8]}"
    logs = tmp_path_factory.mktemp("robust-stack")
    worker = start_worker(logs, model, redis_url, prefix)
    gateway = start_gateway(logs, model, redis_url, prefix)
    try:
        url = gateway_url(redis_url, prefix, gateway)
        wait_ready(url, [worker, gateway])
        client = redis.Redis.from_url(redis_url)
        (key,) = list(client.scan_iter(f"{prefix}:svc:worker:*"))
        admin = json.loads(client.get(key) or b"{}")["endpoints"]["admin"]
        client.close()
        yield RealStack(url, admin, worker)
    except BaseException:
        for log in sorted(logs.glob("*.log")):
            sys.stderr.write(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}\n")
        raise
    finally:
        stop_process(gateway)
        stop_process(worker)


def complete(stack: RealStack, **fields: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "ignore_eos": True, **fields}
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)


def assert_served(stack: RealStack) -> None:
    ok = complete(stack, temperature=0)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 4
    assert ok.json()["choices"][0]["finish_reason"] == "length"
    assert stack.worker.poll() is None, "the worker process exited"
    assert httpx.get(f"{stack.worker_admin}/ready", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"top_p": 1e-50}, "top_p", "must be >= 1.401298464324817e-45"),
        ({"top_k": 2**63}, "top_k", "top_k must be an integer >= 1"),
    ],
)
def test_sampler_killers_are_400s_and_the_worker_lives_on(
    real_stack: RealStack, fields: dict[str, Any], param: str, needle: str
) -> None:
    bad = complete(real_stack, **fields)
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param in error["message"] and needle in error["message"]
    assert_served(real_stack)


def test_float32_edge_params_that_are_valid_are_served(real_stack: RealStack) -> None:
    # Non-greedy at the smallest temperature, with a subnormal top_p: the argmax, no NaN.
    greedy = complete(real_stack, temperature=0)
    edge = complete(real_stack, temperature=1e-5, top_p=1e-40, seed=3)
    assert edge.status_code == 200, edge.text
    assert edge.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert_served(real_stack)


# -- the broken-engine state machine --------------------------------------------------------------


def zero_stats() -> EngineStats:
    return EngineStats(0, 0, 8, 8, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


@dataclass
class FakeEngine:
    """What EngineLoop drives, scripted: every step fails all its requests (or raises ``step_raises``)."""

    add_raises: Exception | None = None
    step_raises: Exception | None = None
    max_model_len: int = 64
    dtype: torch.dtype = torch.float32
    kv_salt: str = "fake"
    requests: list[str] = field(default_factory=list)
    aborted_all: list[str] = field(default_factory=list)
    consecutive_failed_steps: int = 0
    last_failure: str | None = None
    last_step: None = None  # no step records: these steps never compute anything

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def take_loads(self) -> list[object]:
        return []

    def queue_snapshot(self) -> tuple[list[list[Any]], list[list[int]]]:
        return [[1, 0, 0] for _ in self.requests], []

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, **_: object) -> None:
        if self.add_raises is not None:
            raise self.add_raises
        self.requests.append(request_id)

    def abort_request(self, request_id: str) -> None:
        self.requests.remove(request_id)

    def abort_all(self) -> list[str]:
        self.aborted_all, self.requests = list(self.requests), []
        return self.aborted_all

    def step(self) -> list[RequestOutput]:
        if self.step_raises is not None:
            raise self.step_raises
        self.consecutive_failed_steps += 1
        self.last_failure = "RuntimeError: injected"
        failed, self.requests = self.requests, []
        return [
            RequestOutput(rid, [], None, True, FinishReason.ABORT, 2, 0, error="engine step failed: injected")
            for rid in failed
        ]

    def stats(self) -> EngineStats:
        return zero_stats()


class Errors:
    """``on_error`` callbacks, awaitable in order."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, BaseException]] = asyncio.Queue()

    def __call__(self, request_id: str, exc: BaseException) -> None:
        self.queue.put_nowait((request_id, exc))

    async def next(self) -> tuple[str, BaseException]:
        return await asyncio.wait_for(self.queue.get(), 30)


@pytest.fixture
def errors() -> Errors:
    return Errors()


async def started(engine: FakeEngine, errors: Errors, max_failed_steps: int = 3) -> EngineLoop:
    loop = EngineLoop(engine, asyncio.get_running_loop(), lambda _: None, errors, max_failed_steps)  # type: ignore[arg-type]
    loop.start()
    return loop


PARAMS = SamplingParams(max_tokens=2)


async def test_failed_steps_fail_their_requests_then_break_the_engine(errors: Errors) -> None:
    engine = FakeEngine()
    loop = await started(engine, errors, max_failed_steps=3)
    try:
        for i in range(3):
            loop.add(f"r{i}", [1, 2], PARAMS)
            rid, exc = await errors.next()
            assert rid == f"r{i}" and isinstance(exc, RequestFailedError)
            assert exc.kind is ErrorKind.INTERNAL and str(exc) == "engine step failed: injected"
        rid, exc = await errors.next()
        assert rid == "" and isinstance(exc, EngineBrokenError)
        assert (
            loop.broken == "EngineBrokenError: 3 engine steps failed in a row (last: RuntimeError: injected)"
        )
        loop.add("late", [1, 2], PARAMS)
        rid, exc = await errors.next()
        assert rid == "late" and isinstance(exc, EngineUnavailableError)
        assert exc.kind is ErrorKind.UNAVAILABLE and "retry on another worker" in str(exc)
        assert loop.broken in str(exc)
        assert loop.alive and engine.requests == []  # nothing reached the engine
    finally:
        await loop.stop()
    assert not loop.alive and loop.failure is None


async def test_a_failure_outside_a_step_breaks_the_engine(errors: Errors) -> None:
    engine = FakeEngine(add_raises=RuntimeError("tokenizer state corrupted"))
    loop = await started(engine, errors)
    try:
        loop.add("r0", [1, 2], PARAMS)
        rid, exc = await errors.next()
        assert rid == "" and isinstance(exc, RuntimeError)
        assert loop.broken == "RuntimeError: tokenizer state corrupted"
        assert loop.alive  # it stays up to answer commands
    finally:
        await loop.stop()


async def test_a_broken_worker_stays_up_says_why_and_refuses_work(
    redis_url: str, registry_prefix: str, tmp_path: Path
) -> None:
    service = WorkerService(worker_settings(redis_url, registry_prefix))
    engine = FakeEngine(
        step_raises=EngineBrokenError("the KV block pool is inconsistent after a failed step")
    )
    service.engine = engine  # type: ignore[assignment]
    service.engine_info = EngineInfo(
        100, False, engine.max_model_len, "float32", "cpu", engine.kv_salt, "torch", b"\0" * 16, 1, 1
    )
    service.model_dir, service.served_model_name = tmp_path, MODEL_NAME
    failed: list[tuple[bytes, str, ErrorKind, str]] = []
    failed_event = asyncio.Event()

    def record_fail(identity: bytes, request_id: str, kind: ErrorKind, message: str) -> None:
        failed.append((identity, request_id, kind, message))
        failed_event.set()

    service._loop_engine = EngineLoop(
        engine, asyncio.get_running_loop(), service._on_outputs, service._on_error
    )  # type: ignore[arg-type]
    # The generate channel as startup builds it (a real ROUTER on loopback), its sends recorded.
    service.generate = GenerateRole(
        service._loop_engine,
        None,
        b"\0" * 16,
        16,
        "127.0.0.1",
        0,
        lambda ids: None,
        service.loops,  # type: ignore[arg-type]
    )
    service.generate._fail = record_fail  # type: ignore[method-assign]
    service._accepting = True  # as after startup
    registry = Registry.from_url(redis_url, registry_prefix)
    record = ServiceRecord(kind="worker", instance_id="w-broken", endpoints={}, meta=service._meta())
    service._registration = Registration(registry, record, ttl_s=0.6)  # a heartbeat every 0.2 s
    await service._registration.start()
    service._loop_engine.start()
    try:
        assert service.readiness() == (True, []) and record.meta["broken"] is None

        service.generate._routes["r1"] = b"front-end"
        service._loop_engine.add("r1", [1, 2], PARAMS)
        await asyncio.wait_for(failed_event.wait(), 30)

        reason = "EngineBrokenError: the KV block pool is inconsistent after a failed step"
        assert failed == [
            (b"front-end", "r1", ErrorKind.INTERNAL, f"worker engine failed: {reason.split(': ', 1)[1]}")
        ]
        assert service.broken == reason and service.problems() == [f"engine broken: {reason}"]
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(admin_app(service)), base_url="http://w"
        ) as http:
            ready = await http.get("/ready")
            info = (await http.get("/info")).json()
        assert ready.status_code == 503
        assert ready.json() == {"ready": False, "problems": [f"engine broken: {reason}"]}
        assert info["problems"] == [f"engine broken: {reason}"]
        assert service._meta()["broken"] == reason
        assert await registry_meta(registry, "w-broken", "broken") == reason

        failed.clear()
        failed_event.clear()
        service.generate._routes["r2"] = b"front-end"
        service._loop_engine.add("r2", [1, 2], PARAMS)
        await asyncio.wait_for(failed_event.wait(), 30)
        ((identity, rid, kind, message),) = failed
        assert (identity, rid, kind) == (b"front-end", "r2", ErrorKind.UNAVAILABLE)
        assert message == f"this worker's engine is broken ({reason}); retry on another worker"
        assert not service.stopping.is_set()  # the worker does not exit
    finally:
        await service._loop_engine.stop()
        service.generate.close()
        await service.loops.close()
        await service._registration.close()
        await registry.close()


async def registry_meta(registry: Registry, instance_id: str, key: str, timeout_s: float = 30) -> Any:
    """``meta[key]`` of the record in Redis once a heartbeat has written it (None until then)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = await registry.get("worker", instance_id)
        if record is not None and record.meta.get(key) is not None:
            return record.meta[key]
        await asyncio.sleep(0.05)  # waiting on Redis, which has no event to await
    raise AssertionError(f"meta[{key!r}] of {instance_id} never reached the registry")


def worker_settings(redis_url: str, prefix: str) -> WorkerSettings:
    return WorkerSettings(
        host="127.0.0.1",
        advertise_host="127.0.0.1",
        redis_url=redis_url,
        registry_prefix=prefix,
        registry_ttl_s=0.6,
        instance_id="w-broken",
        log_level="warning",
        model=None,
        served_model_name=MODEL_NAME,
        block_size=16,
        num_kv_blocks=8,
        kv_cache_memory_mib=16,
        prefault=True,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_prefill_step_tokens=2048,
        max_model_len=64,
        enable_prefix_caching=True,
        torch_threads=1,
        prefill_threads=0,
        device="cpu",
        dtype="float32",
        engine_core="thread",
        kernels="auto",
        zmq_port=0,
        admin_port=0,
        role="mixed",
        kv_store=False,
        kv_lease_s=30.0,
        write_behind_blocks=0,
        write_behind_defer_s=0.0,
        transfer_port=0,
        busy_poll_us=0,
    )


def _resident_bytes(path: str) -> int:
    """Bytes of ``path``'s mappings in this process that are in memory (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


async def test_prefault_puts_the_whole_kv_cache_in_memory_before_serving(
    redis_url: str, registry_prefix: str
) -> None:
    """--prefault (the default) faults the KV cache's pages in at start, as the store node does its
    segment: no block's first write pays page faults on the prefill or the KV pull."""
    service = WorkerService(worker_settings(redis_url, registry_prefix))
    client = redis.asyncio.Redis.from_url(redis_url)
    engine = TransferEngine("prefault-test", SegmentDirectory(client, prefix=registry_prefix))
    try:
        service._region = KVRegion(engine)
        region = service._region.register((64, 4, 2, 16, 2, 32), torch.float32)  # 64 blocks of 32 KiB
        assert _resident_bytes(region.path) == 0  # a fresh region: nothing faulted in yet
        await service._prefault()
        assert _resident_bytes(region.path) == region.size == 64 * 32 * 1024
    finally:
        await engine.close()
        await client.aclose()


def test_the_engine_device_is_the_one_asked_for_and_cuda_needs_a_gpu() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda") == "cuda"
    else:
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            resolve_device("cuda")
