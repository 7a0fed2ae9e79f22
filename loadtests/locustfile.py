"""Locust load test of the OpenAI API of a running stack (`make run` first).

Each simulated user sends chat completions that share a long system prompt (so the prefix cache has
something to hit) and streams half of them. Bounded by design: run it with a user count and a
run time, e.g.

    .venv/bin/locust -f loadtests/locustfile.py --headless -u 8 -r 2 --run-time 60s \
        --host http://127.0.0.1:8000

Set YUTU_MODEL to the served model name if it is not the built-in demo model.
"""

from __future__ import annotations

import json
import os
import random

from locust import HttpUser, between, task

MODEL = os.environ.get("YUTU_MODEL", "yutu-demo-tiny")
SYSTEM = "You are a helpful assistant. " * 40  # ~300 tokens shared by every request
TOPICS = ["the moon", "rabbits", "KV caches", "schedulers", "tea", "rivers", "prime numbers", "bridges"]


class ChatUser(HttpUser):
    wait_time = between(0.1, 0.5)

    def _body(self, stream: bool) -> dict[str, object]:
        return {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Tell me about {random.choice(TOPICS)}."},
            ],
            "max_tokens": random.randint(8, 48),
            "temperature": 0.7,
            "stream": stream,
        }

    @task
    def chat(self) -> None:
        self.client.post("/v1/chat/completions", json=self._body(stream=False), name="chat")

    @task
    def chat_stream(self) -> None:
        with self.client.post(
            "/v1/chat/completions",
            json=self._body(stream=True),
            name="chat (stream)",
            stream=True,
            catch_response=True,
        ) as response:
            done = False
            for line in response.iter_lines():
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    json.loads(line[6:])
            if not done:
                response.failure("stream ended without [DONE]")
