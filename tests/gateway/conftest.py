"""Fixtures of the gateway tests.

- ``tiny_model``: a tiny random Llama checkpoint (vocab 512, byte-level BPE, chat template).
- ``FakeWorker``: a scripted worker on a real generate-channel router, registered in the real Redis, that
  records what the gateway sends (requests, aborts) and answers what the test tells it to. It
  tests the gateway's control logic (aborts, worker loss, failures) where a real engine cannot be
  steered; everything about real generation is tested against ``stack`` instead.
- ``running_gateway``: a gateway served inside the test's event loop (real HTTP on loopback).
- ``stack``: a real worker and a real gateway as subprocesses (session scope, shared by most tests).
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import torch
from gateway_support import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    FakeWorker,
    Stack,
    gateway_url,
    start_gateway,
    start_worker,
    stop_process,
    wait_ready,
)
from yutu.engine.testing import make_tiny_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gw-model") / "tiny", arch="llama", seed=0)


@pytest.fixture
async def fake_worker(redis_url: str, registry_prefix: str) -> AsyncIterator[FakeWorker]:
    worker = await FakeWorker(redis_url, registry_prefix).start()
    try:
        yield worker
    finally:
        await worker.close()


@pytest.fixture(scope="session")
def stack(tiny_model: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One real worker (64 KV blocks of 16 tokens, context 256) and one gateway (tool calls in the
    hermes format), shared by the gateway tests."""
    prefix = f"yutu-gw-{uuid.uuid4().hex[:8]}"
    logs = tmp_path_factory.mktemp("gw-stack")
    worker = start_worker(logs, tiny_model, redis_url, prefix)
    gateway = start_gateway(logs, tiny_model, redis_url, prefix, "--tool-call-parser", "hermes")
    try:
        url = gateway_url(redis_url, prefix, gateway)
        wait_ready(url, [worker, gateway])
        client = redis.Redis.from_url(redis_url)
        (key,) = list(client.scan_iter(f"{prefix}:svc:worker:*"))
        worker_admin = json.loads(client.get(key) or b"{}")["endpoints"]["admin"]
        client.close()
        yield Stack(url, worker_admin, redis_url, prefix, tiny_model, logs, BLOCK_SIZE, MAX_MODEL_LEN)
    except BaseException:
        for log in sorted(logs.glob("*.log")):
            sys.stderr.write(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}\n")
        raise
    finally:
        stop_process(gateway)
        stop_process(worker)
