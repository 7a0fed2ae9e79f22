"""Heartbeats on the generate channel, with real processes frozen by SIGSTOP.

Found on main: a frozen worker keeps its TCP connection, so the gateway kept routing requests to
it, they hung, and its /ready stayed 200. Now a worker silent past the gateway's liveness window
gets no new requests and its in-flight ones fail UNAVAILABLE; it returns to rotation when it
answers again. The other way round, a worker whose front end stops pinging aborts that front
end's requests, so their KV blocks are freed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis
from gateway_support import (
    MODEL_NAME,
    gateway_url,
    start_gateway,
    start_worker,
    stop_process,
    wait_idle,
    wait_ready,
    worker_info,
)

WINDOW_S = 3.0  # the gateway's --worker-liveness-timeout in these tests
BOUND_S = 15.0  # the window plus generous slack: an error, never a hang
STREAM = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
          "ignore_eos": True, "stream": True}  # fmt: skip
SHORT = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@contextmanager
def processes(*procs: subprocess.Popen[bytes]) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            stop_process(proc)


def admin_url(redis_url: str, prefix: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> str:
    """The admin URL a worker subprocess registered."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "worker exited during start-up"
            for key in client.scan_iter(f"{prefix}:svc:worker:*"):
                raw = client.get(key)
                if raw is not None and json.loads(raw)["pid"] == proc.pid:
                    return str(json.loads(raw)["endpoints"]["admin"])
            time.sleep(0.1)
    finally:
        client.close()
    raise AssertionError("worker did not register")


def stream(url: str, body: dict[str, Any] = STREAM) -> list[dict[str, Any]]:
    """The SSE events of a streamed completion (``[DONE]`` last, as {"done": True})."""
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append({"done": True} if data == "[DONE]" else json.loads(data))
    return events


def error_of(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    assert events[-1] == {"done": True}, events[-3:]
    errors = [e["error"] for e in events if "error" in e]
    return errors[0] if errors else None


def finished_normally(events: list[dict[str, Any]]) -> bool:
    reasons = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    return error_of(events) is None and reasons == ["length"]


def wait_live(url: str, instance_ids: set[str], timeout_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        workers = httpx.get(f"{url}/info", timeout=10).json()["workers"]
        if {w["instance_id"] for w in workers if w["live"]} >= instance_ids:
            return
        assert time.monotonic() < deadline, f"workers not live again: {workers}"
        time.sleep(0.1)


def instance_of(admin: str) -> str:
    return str(worker_info(admin)["instance_id"])


def assert_stopped_answering(error: dict[str, Any] | None, instance_id: str) -> None:
    assert error is not None and error["type"] == "service_unavailable", error
    message = error["message"].split("; it could not be moved: ")[0]  # (no other worker took it over)
    prefix = f"worker {instance_id} stopped answering for "
    assert message.startswith(prefix) and message.endswith(" s: retry the request"), message
    # silent for more than the window; the message rounds to 0.1 s, so 3.04 s of a 3 s window reads 3.0
    assert float(message[len(prefix) :].split(" ")[0]) >= WINDOW_S


def test_a_frozen_worker_fails_its_requests_gets_none_new_and_returns_when_it_answers(
    tiny_model: Path, redis_url: str, registry_prefix: str, tmp_path: Path
) -> None:
    ttl = ["--registry-ttl", "60"]  # the record outlives the freeze: only the heartbeats can tell
    worker = start_worker(tmp_path, tiny_model, redis_url, registry_prefix, *ttl)
    gateway = start_gateway(
        tmp_path, tiny_model, redis_url, registry_prefix, *ttl, "--worker-liveness-timeout", str(WINDOW_S),
        "--failover-wait", "0",  # its one worker frozen: no other to move the stream to, none waited for
    )  # fmt: skip
    with processes(gateway, worker), ThreadPoolExecutor(2) as pool:
        url = gateway_url(redis_url, registry_prefix, gateway)
        wait_ready(url, [worker, gateway])
        admin = admin_url(redis_url, registry_prefix, worker)
        wid = instance_of(admin)
        assert finished_normally(stream(url))

        worker.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        in_flight = pool.submit(stream, url)  # routed to the frozen worker: not yet known to be frozen
        error = error_of(in_flight.result(timeout=BOUND_S))
        assert time.monotonic() - frozen_at < BOUND_S
        assert_stopped_answering(error, wid)
        resp = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=10)  # at once, not a hang
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"
        ready = httpx.get(f"{url}/ready", timeout=10)
        assert ready.status_code == 503
        assert any("no live worker serving model 'tiny'" in p for p in ready.json()["problems"])
        workers = httpx.get(f"{url}/info", timeout=10).json()["workers"]
        assert [(w["instance_id"], w["silent"], w["connected"]) for w in workers] == [(wid, True, True)]

        worker.send_signal(signal.SIGCONT)
        wait_ready(url, [worker, gateway], timeout_s=BOUND_S)
        resp = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=30)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        # The failed request was aborted on the worker too: nothing left, no block leaked.
        info = wait_idle(admin, BOUND_S)
        assert info["engine"]["num_free_blocks"] == info["engine"]["num_kv_blocks"]
        assert httpx.post(f"{admin}/debug/check_integrity", timeout=10).json()["ok"] is True


def test_with_two_workers_requests_after_a_freeze_go_to_the_live_one(
    tiny_model: Path, redis_url: str, registry_prefix: str, tmp_path: Path
) -> None:
    ttl = ["--registry-ttl", "60"]
    frozen = start_worker(tmp_path, tiny_model, redis_url, registry_prefix, *ttl)
    other = start_worker(tmp_path, tiny_model, redis_url, registry_prefix, *ttl)
    gateway = start_gateway(
        tmp_path, tiny_model, redis_url, registry_prefix, *ttl, "--worker-liveness-timeout", str(WINDOW_S)
    )
    with processes(gateway, frozen, other), ThreadPoolExecutor(8) as pool:
        url = gateway_url(redis_url, registry_prefix, gateway)
        frozen_admin = admin_url(redis_url, registry_prefix, frozen)
        other_admin = admin_url(redis_url, registry_prefix, other)
        ids = {instance_of(frozen_admin), instance_of(other_admin)}
        wait_ready(url, [frozen, other, gateway])
        wait_live(url, ids)

        frozen.send_signal(signal.SIGSTOP)
        # Two at once: the least-loaded pick puts one on each worker.
        pair: list[Future[list[dict[str, Any]]]] = [pool.submit(stream, url) for _ in range(2)]
        results = [f.result(timeout=BOUND_S) for f in pair]
        # The one on the frozen worker moves to the live one once the freeze shows: both finish
        # ("length": all 200 tokens).
        assert all(finished_normally(r) for r in results), results
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert f'yutu_gateway_migrations_total{{model="{MODEL_NAME}"}} 1.0' in metrics
        # From now on every request is served by the live worker.
        before = worker_info(other_admin)["engine"]["generation_tokens_total"]
        later = [pool.submit(httpx.post, f"{url}/v1/completions", json=SHORT, timeout=30) for _ in range(6)]
        for f in later:
            resp = f.result(timeout=60)
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        assert worker_info(other_admin)["engine"]["generation_tokens_total"] == before + 6 * 4
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 200

        frozen.send_signal(signal.SIGCONT)
        wait_live(url, ids)  # back in rotation: it serves again
        served = worker_info(frozen_admin)["engine"]["generation_tokens_total"]
        two = [pool.submit(stream, url) for _ in range(2)]
        assert all(finished_normally(f.result(timeout=60)) for f in two)
        assert worker_info(frozen_admin)["engine"]["generation_tokens_total"] == served + 200
        for admin in (frozen_admin, other_admin):
            wait_idle(admin, BOUND_S)
            assert httpx.post(f"{admin}/debug/check_integrity", timeout=10).json()["ok"] is True


def test_a_frozen_gateway_has_its_requests_aborted_by_the_worker(
    tiny_model: Path, redis_url: str, registry_prefix: str, tmp_path: Path
) -> None:
    # One sequence at a time: 40 streams of 200 tokens queue up on the worker for seconds.
    worker = start_worker(
        tmp_path, tiny_model, redis_url, registry_prefix, "--registry-ttl", "60", "--max-num-seqs", "1"
    )
    gateway = start_gateway(
        tmp_path, tiny_model, redis_url, registry_prefix, "--worker-liveness-timeout", "2"
    )
    n = 40
    with processes(gateway, worker), ThreadPoolExecutor(n) as pool:
        url = gateway_url(redis_url, registry_prefix, gateway)
        wait_ready(url, [worker, gateway])
        admin = admin_url(redis_url, registry_prefix, worker)
        before = worker_info(admin)["engine"]["generation_tokens_total"]
        streams = [pool.submit(stream, url) for _ in range(n)]
        deadline = time.monotonic() + BOUND_S
        while worker_info(admin)["in_flight"] < 30:  # >= 30 x 200 tokens to go: longer than the window
            assert time.monotonic() < deadline, "the requests did not reach the worker"
            time.sleep(0.01)
        gateway.send_signal(signal.SIGSTOP)
        try:
            info = wait_idle(admin, BOUND_S)  # the worker gave up on the silent front end
            assert info["engine"]["generation_tokens_total"] - before < n * 200  # aborted, not finished
            assert info["engine"]["num_free_blocks"] == info["engine"]["num_kv_blocks"]
            assert httpx.post(f"{admin}/debug/check_integrity", timeout=10).json()["ok"] is True
        finally:
            gateway.send_signal(signal.SIGCONT)
        results = [f.result(timeout=60) for f in streams]
        errors = [error_of(r) for r in results]
        aborted = [e for e in errors if e is not None]
        assert aborted and len(aborted) + sum(finished_normally(r) for r in results) == n
        for e in aborted:  # the gateway, awake again, hears why from the worker
            assert e["type"] == "service_unavailable"
            assert "heard no heartbeat from this front end" in e["message"] and "retry it" in e["message"]
        # The gateway did not blame the worker for its own freeze: it serves again at once.
        wait_ready(url, [worker, gateway], timeout_s=BOUND_S)
        resp = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=30)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
