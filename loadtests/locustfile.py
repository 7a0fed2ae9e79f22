"""Locust load test of the OpenAI API of a running stack (`make run` first).

Each simulated user sends chat and text completions, streamed and not. A share of the prompts
starts with a long prefix common to every user (so prefix caches and the KV store have something to
hit); the rest is fresh. Streamed requests report two metrics of their own next to the requests:
``TTFT`` (send -> first chunk with text) and ``ITL`` (every gap between later ones), under the
request type ``metric``. Bounded by design: run it with a user count and a run time, e.g.

    .venv/bin/locust -f loadtests/locustfile.py --headless -u 8 -r 2 --run-time 60s \\
        --host http://127.0.0.1:8000

Shape it with environment variables:

    YUTU_MODEL            served model name (default: the built-in demo model, yutu-demo-tiny)
    YUTU_PROMPT_WORDS     words per prompt (default 200)
    YUTU_SHARED_RATIO     share of each prompt that is the common prefix, 0..1 (default 0.75)
    YUTU_MAX_TOKENS       output tokens per request (default 32)
    YUTU_STREAM_RATIO     share of requests streamed, 0..1 (default 0.5)
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from locust import HttpUser, between, events, task

MODEL = os.environ.get("YUTU_MODEL", "yutu-demo-tiny")


def _env_float(name: str, default: float, low: float, high: float) -> float:
    value = float(os.environ.get(name, default))
    if not low <= value <= high:
        raise SystemExit(f"locustfile: {name}={value} must be within [{low}, {high}]")
    return value


PROMPT_WORDS = int(_env_float("YUTU_PROMPT_WORDS", 200, 1, 100_000))
SHARED_RATIO = _env_float("YUTU_SHARED_RATIO", 0.75, 0.0, 1.0)
MAX_TOKENS = int(_env_float("YUTU_MAX_TOKENS", 32, 1, 100_000))
STREAM_RATIO = _env_float("YUTU_STREAM_RATIO", 0.5, 0.0, 1.0)
WORDS = ["moon", "rabbit", "cache", "scheduler", "tea", "river", "prime", "bridge", "lantern", "harbor"]
SHARED = " ".join(WORDS[i % len(WORDS)] for i in range(int(PROMPT_WORDS * SHARED_RATIO)))


def prompt() -> str:
    fresh = " ".join(random.choice(WORDS) for _ in range(PROMPT_WORDS - int(PROMPT_WORDS * SHARED_RATIO)))
    return f"{SHARED} {fresh}".strip()


def _metric(name: str, seconds: float) -> None:
    events.request.fire(request_type="metric", name=name, response_time=seconds * 1000, response_length=0,
                        exception=None, context={})  # fmt: skip


class OpenAIUser(HttpUser):
    wait_time = between(0.1, 0.5)

    def _send(self, path: str, name: str, body: dict[str, Any]) -> None:
        body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.7, **body}
        if random.random() >= STREAM_RATIO:
            with self.client.post(path, json=body, name=name, catch_response=True) as response:
                if response.status_code == 200 and not response.json().get("choices"):
                    response.failure("no choices in the response")
            return
        body["stream"] = True
        sent = time.perf_counter()
        chunks: list[float] = []
        with self.client.post(
            path, json=body, name=f"{name} (stream)", stream=True, catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"{response.status_code}: {response.text[:200]}")
                return
            done = False
            for line in response.iter_lines():
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        response.failure(f"error event: {event['error']}")
                        return
                    for choice in event.get("choices") or ():
                        if choice.get("text") or (choice.get("delta") or {}).get("content"):
                            chunks.append(time.perf_counter())  # text reached the client
                            break
            if not done:
                response.failure("stream ended without [DONE]")
                return
        if chunks:
            _metric("TTFT", chunks[0] - sent)
            for a, b in zip(chunks, chunks[1:], strict=False):
                _metric("ITL", b - a)

    @task
    def chat(self) -> None:
        self._send("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": prompt()}]})

    @task
    def completion(self) -> None:
        self._send("/v1/completions", "completion", {"prompt": prompt()})
