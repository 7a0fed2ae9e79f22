"""Redis is only the registry: losing it (even its data) must not stop requests from being served."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import httpx
import redis
from gateway_support import MODEL_NAME, gateway_url, start_gateway, start_worker, stop_process, wait_ready
from yutu.launcher import ProcessGroup, free_port, start_redis

CMPL = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 4, "temperature": 0}


def complete(url: str) -> list[int]:
    resp = httpx.post(f"{url}/v1/completions", json={**CMPL, "return_tokens_as_token_ids": True}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4
    return list(resp.json()["choices"][0]["text"])


def test_requests_survive_a_redis_restart_that_loses_its_data(tiny_model: Path, tmp_path: Path) -> None:
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    prefix = f"yutu-outage-{uuid.uuid4().hex[:6]}"
    group = ProcessGroup()
    start_redis(group, redis_url, tmp_path / "redis")
    ttl = ["--registry-ttl", "3"]
    worker = start_worker(tmp_path, tiny_model, redis_url, prefix, *ttl)
    gateway = start_gateway(tmp_path, tiny_model, redis_url, prefix, *ttl)
    stop = threading.Event()
    failures: list[str] = []
    served = 0
    try:
        url = gateway_url(redis_url, prefix, gateway)
        wait_ready(url, [worker, gateway])
        expected = complete(url)

        def keep_asking() -> None:  # requests run all through the outage and the recovery
            nonlocal served
            while not stop.is_set():
                try:
                    assert complete(url) == expected
                    served += 1
                except (AssertionError, httpx.HTTPError) as exc:
                    failures.append(repr(exc))

        load = threading.Thread(target=keep_asking)
        load.start()
        time.sleep(0.5)
        group.stop()  # Redis gone: the gateway keeps serving with the workers it knows
        time.sleep(1.5)
        assert httpx.get(f"{url}/ready").status_code == 200
        start_redis(group, redis_url, tmp_path / "redis")  # back, but empty: every record is lost
        client = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 10
        while not list(client.scan_iter(f"{prefix}:svc:worker:*")):  # the worker re-registers
            assert time.monotonic() < deadline, "worker did not re-register"
            time.sleep(0.05)
        client.close()
        time.sleep(1.0)
        stop.set()
        load.join(timeout=60)
        assert failures == []
        assert served >= 10
        assert worker.poll() is None and gateway.poll() is None
    finally:
        stop.set()
        stop_process(gateway)
        stop_process(worker)
        group.stop()
