"""Operations with real processes: a client leaving frees the worker, a worker dying (its streams
moved to the next worker, or ended with an error when none comes), /metrics."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from gateway_support import (
    MODEL_NAME,
    Stack,
    gateway_url,
    start_gateway,
    start_worker,
    stop_process,
    wait_idle,
    wait_ready,
    worker_info,
)
from yutu.transfer.region import sweep_stale_region_files


def test_client_disconnect_mid_stream_frees_the_worker(stack: Stack) -> None:
    wait_idle(stack.worker_admin)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        got = 0
        while got < 3:  # a few tokens in: the request is running on the worker
            if next(lines).startswith("data: {"):
                got += 1
        busy = worker_info(stack.worker_admin)
        assert busy["in_flight"] == 1 and busy["engine"]["num_running"] == 1
        assert busy["engine"]["kv_usage"] > 0
    # The client hung up: the gateway aborts the request and the worker frees its blocks.
    info = wait_idle(stack.worker_admin)
    assert info["engine"]["kv_usage"] == 0.0
    assert info["engine"]["num_free_blocks"] == info["engine"]["num_kv_blocks"]
    assert info["engine"]["generation_tokens_total"] < busy["engine"]["generation_tokens_total"] + 150
    # Same for a non-streamed request whose client gives up.
    try:
        httpx.post(
            f"{stack.base_url}/v1/completions", json={**body, "stream": False, "max_tokens": 240}, timeout=0.3
        )
    except httpx.ReadTimeout:
        pass
    info = wait_idle(stack.worker_admin)
    assert info["engine"]["kv_usage"] == 0.0


def test_metrics_have_latency_histograms_and_counters(stack: Stack) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=30).status_code == 200
    assert httpx.post(f"{stack.base_url}/v1/completions", json={**body, "model": "nope"}).status_code == 404
    responses = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2}
    assert httpx.post(f"{stack.base_url}/v1/responses", json=responses, timeout=30).status_code == 200
    assert httpx.get(f"{stack.base_url}/v1/responses/resp_1").status_code == 404
    text = httpx.get(f"{stack.base_url}/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    label = f'model="{MODEL_NAME}"'
    assert samples[f"yutu_gateway_time_to_first_token_seconds_count{{{label}}}"] >= 1
    assert samples[f'yutu_gateway_time_to_first_token_seconds_bucket{{le="+Inf",{label}}}'] >= 1
    assert samples[f"yutu_gateway_inter_token_latency_seconds_count{{{label}}}"] >= 3
    assert samples[f"yutu_gateway_e2e_request_latency_seconds_count{{{label}}}"] >= 1
    assert samples[f"yutu_gateway_prompt_tokens_total{{{label}}}"] >= 2
    assert samples[f"yutu_gateway_generation_tokens_total{{{label}}}"] >= 4
    assert samples[f'yutu_gateway_request_finish_total{{finish_reason="length",{label}}}'] >= 1
    assert samples['yutu_gateway_requests_total{route="/v1/completions",status="200"}'] >= 1
    assert samples['yutu_gateway_requests_total{route="/v1/completions",status="404"}'] >= 1
    assert samples['yutu_gateway_requests_total{route="/v1/responses",status="200"}'] >= 1
    assert samples['yutu_gateway_requests_total{route="/v1/responses/{id}",status="404"}'] >= 1
    assert samples[f"yutu_gateway_requests_in_flight{{{label}}}"] == 0


def _token_ids(choice: dict[str, Any]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in (choice.get("logprobs") or {}).get("tokens") or []]


def test_a_killed_worker_hands_its_stream_to_the_next_one_with_no_token_lost(
    tiny_model: Path, redis_url: str, registry_prefix: str, tmp_path: Path
) -> None:
    """The only worker is SIGKILLed mid-stream and another starts (as yutu up restarts it): the
    stream waits for it (--failover-wait, 30 s by default), which computes the prompt and the tokens
    streamed so far and goes on -- the client sees every token once, the greedy reference's."""
    worker = start_worker(tmp_path, tiny_model, redis_url, registry_prefix)
    gateway = start_gateway(tmp_path, tiny_model, redis_url, registry_prefix)
    replacement: subprocess.Popen[bytes] | None = None
    try:
        url = gateway_url(redis_url, registry_prefix, gateway)
        wait_ready(url, [worker, gateway])
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9] * 4, "max_tokens": 160, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        reference = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert reference.status_code == 200, reference.text
        want = _token_ids(reference.json()["choices"][0])
        assert len(want) == 160
        tokens: list[int] = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                assert "error" not in event, event
                for choice in event["choices"]:
                    tokens += _token_ids(choice)
                if replacement is None and len(tokens) >= 20:
                    worker.send_signal(signal.SIGKILL)  # mid-stream, no goodbye
                    worker.wait(10)
                    replacement = start_worker(tmp_path, tiny_model, redis_url, registry_prefix)
        assert replacement is not None
        assert tokens == want  # nothing repeated, nothing lost
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert f'yutu_gateway_migrations_total{{model="{MODEL_NAME}"}} 1.0' in metrics
    finally:
        stop_process(gateway)
        stop_process(worker)
        if replacement is not None:
            stop_process(replacement)
    sweep_stale_region_files(str(tmp_path / "shm"))  # the killed worker's KV region: reclaimable
    assert not list((tmp_path / "shm").iterdir())


def test_a_killed_worker_ends_the_stream_with_an_error_then_done(
    tiny_model: Path, redis_url: str, registry_prefix: str, tmp_path: Path
) -> None:
    """With no worker to take the stream over (--failover-wait 0: none is waited for)."""
    worker = start_worker(tmp_path, tiny_model, redis_url, registry_prefix)
    gateway = start_gateway(tmp_path, tiny_model, redis_url, registry_prefix, "--failover-wait", "0")
    try:
        url = gateway_url(redis_url, registry_prefix, gateway)
        wait_ready(url, [worker, gateway])
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 240, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        started = time.monotonic()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
            events: list[str] = []
            for line in resp.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:
                    worker.send_signal(signal.SIGKILL)  # mid-request, no goodbye
        assert time.monotonic() - started < 10  # an error, not a hang until the record expires
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][len("data: ") :])["error"]
        assert err["type"] == "service_unavailable" and "disconnected" in err["message"]
        assert all("choices" in json.loads(e[len("data: ") :]) for e in events[:-2])
        # No worker left: the next request is a 503 at once, and the gateway is not ready.
        resp = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=10)
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{url}/ready").status_code == 503
    finally:
        stop_process(gateway)
        stop_process(worker)
    sweep_stale_region_files(str(tmp_path / "shm"))  # the killed worker's KV region: reclaimable
    assert not list((tmp_path / "shm").iterdir())
