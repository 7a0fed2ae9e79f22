"""Bad registry data never stops the gateway finding workers (a real Redis, a real worker process).

Found on main: one malformed record under the worker prefix killed the discovery loop silently
and for good; a worker started afterwards never joined.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from gateway_support import (
    MODEL_NAME,
    FakeWorker,
    gateway_settings,
    running_gateway,
    start_worker,
    stop_process,
)
from yutu.registry import ServiceRecord


def record_json(instance_id: str, **changes: Any) -> str:
    record = ServiceRecord("worker", instance_id, {"generate": "tcp://127.0.0.1:1"}, {"model": MODEL_NAME})
    return json.dumps({**json.loads(record.to_json()), **changes})


async def test_malformed_and_broken_records_are_skipped_once_and_a_real_worker_still_joins(
    tiny_model: Path, redis_url: str, registry_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = f"{registry_prefix}:svc:worker:{{}}".format
    bad = {
        "zz-text": "not json",
        "zz-list": "[1, 2, 3]",
        "zz-types": record_json("zz-types", pid="many", endpoints={"generate": 5}),
        "zz-meta": record_json("zz-meta", meta={"model": MODEL_NAME, "max_model_len": "long"}),
    }
    r = aioredis.from_url(redis_url)
    for instance_id, value in bad.items():
        await r.set(key(instance_id), value, px=120_000)
    broken = FakeWorker(redis_url, registry_prefix)
    broken.registration.update_meta(broken="engine steps kept failing: CUDA error")
    await broken.start()
    worker = None
    caplog.set_level(logging.INFO)
    settings = gateway_settings(tiny_model, redis_url, registry_prefix)
    try:
        async with running_gateway(settings, connected_workers=0) as (url, gw):
            for _ in range(
                3
            ):  # the poll loop reads the registry too: each problem is logged once all the same
                await gw.pool.refresh()
            messages = [rec.getMessage() for rec in caplog.records]

            def logged(needle: str) -> int:
                return sum(needle in m for m in messages)

            assert logged(f"skipping malformed record {key('zz-text')}: not JSON") == 1
            assert logged(f"skipping malformed record {key('zz-list')}: a JSON list, not an object") == 1
            assert logged(f"skipping malformed record {key('zz-types')}: field 'pid' is 'many'") == 1
            assert logged("not sending requests to worker zz-meta: malformed worker record: ValueError") == 1
            assert (
                logged(
                    f"not sending requests to worker {broken.instance_id}: its engine is broken:"
                    " engine steps kept failing: CUDA error"
                )
                == 1
            )
            assert list(gw.pool.workers) == [broken.instance_id] and not gw.pool.usable()

            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"
                assert broken.requests.empty()  # the broken worker was never asked
                ready = await client.get("/ready")
                assert ready.status_code == 503
                assert any("no live worker serving model 'tiny'" in p for p in ready.json()["problems"])

                # An unexpected error in one poll is logged and the loop goes on.
                real_list, failures = gw.pool.registry.list, 2

                async def flaky_list(kind: str) -> list[ServiceRecord]:
                    nonlocal failures
                    if failures:
                        failures -= 1
                        raise RuntimeError("unexpected registry trouble")
                    return await real_list(kind)

                gw.pool.registry.list = flaky_list  # type: ignore[method-assign]
                worker = start_worker(tmp_path, tiny_model, redis_url, registry_prefix)
                deadline = time.monotonic() + 120
                while not gw.pool.live():
                    assert worker.poll() is None, "the worker exited"
                    assert time.monotonic() < deadline, "the real worker never joined"
                    await asyncio.sleep(0.1)
                assert failures == 0
                # the registry is shared by every pool of the gateway: whichever polled got the errors
                assert logged_after(caplog, "failed (the loop goes on)") == 2
                assert gw.loops.problems == {}
                assert [w.info.instance_id for w in gw.pool.live()] != [broken.instance_id]

                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] == 4
                assert (await client.get("/ready")).status_code == 200
                assert broken.requests.empty()
    finally:
        if worker is not None:
            stop_process(worker)
        await broken.close()
        for instance_id in bad:
            await r.delete(key(instance_id))
        await r.aclose()


def logged_after(caplog: pytest.LogCaptureFixture, needle: str) -> int:
    return sum(needle in rec.getMessage() for rec in caplog.records)
