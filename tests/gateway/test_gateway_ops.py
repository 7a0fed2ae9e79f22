"""Operations against the real stack: a client leaving mid-stream frees the worker; /metrics."""

from __future__ import annotations

import time
from typing import Any

import httpx
from gateway_support import MODEL_NAME, Stack


def worker_info(stack: Stack) -> dict[str, Any]:
    info: dict[str, Any] = httpx.get(f"{stack.worker_admin}/info", timeout=5).json()
    return info


def wait_idle(stack: Stack, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        info = worker_info(stack)
        engine = info["engine"]
        if info["in_flight"] == 0 and engine["num_running"] == 0 and engine["num_waiting"] == 0:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"worker still busy: {info}")
        time.sleep(0.05)


def test_client_disconnect_mid_stream_frees_the_worker(stack: Stack) -> None:
    wait_idle(stack)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        got = 0
        while got < 3:  # a few tokens in: the request is running on the worker
            if next(lines).startswith("data: {"):
                got += 1
        busy = worker_info(stack)
        assert busy["in_flight"] == 1 and busy["engine"]["num_running"] == 1
        assert busy["engine"]["kv_usage"] > 0
    # The client hung up: the gateway aborts the request and the worker frees its blocks.
    info = wait_idle(stack)
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
    info = wait_idle(stack)
    assert info["engine"]["kv_usage"] == 0.0


def test_metrics_have_latency_histograms_and_counters(stack: Stack) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=30).status_code == 200
    assert httpx.post(f"{stack.base_url}/v1/completions", json={**body, "model": "nope"}).status_code == 404
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
    assert samples[f"yutu_gateway_requests_in_flight{{{label}}}"] == 0
