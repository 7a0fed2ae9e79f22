"""A grammar held after a reasoning model's thinking, across the prefill/decode hand-off: the
prefill instance samples the first token through the gate (a marker the grammar alone masks), the
decode instance replays it and goes on under the grammar, or thinking."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from yutu.engine.testing import END_THINK, THINK, make_thinking_checkpoint

from tests.disagg.disagg_support import MAX_MODEL_LEN, MODEL_NAME, DisaggStack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[DisaggStack]:
    model = make_thinking_checkpoint(
        tmp_path_factory.mktemp("thinking") / "tiny", max_position_embeddings=MAX_MODEL_LEN
    )
    with DisaggStack(tmp_path_factory.mktemp("dg-reasoning"), model, redis_url, store=False,
                     gateway_flags=("--reasoning-parser", "qwen3")) as s:  # fmt: skip
        yield s


def chat(
    stack: DisaggStack, bias: int, template_kwargs: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24,
            "temperature": 0, "response_format": {"type": "json_object"}, "logit_bias": {str(bias): 100},
            "chat_template_kwargs": template_kwargs}  # fmt: skip
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0], dict(reply.headers)


def test_the_grammar_waits_for_the_thinking_across_the_hand_off(stack: DisaggStack) -> None:
    opened, headers = chat(stack, END_THINK, {"open_thinking": True})  # </think> first, then JSON
    assert headers["x-yutu-prefill"] == "prefill-0" and headers["x-yutu-decode"] == "decode-0"
    assert opened["message"]["reasoning"] == "" and opened["message"]["content"].startswith("{")
    thinking, _ = chat(stack, THINK, {})  # <think> first, then thinking to max_tokens
    assert thinking["finish_reason"] == "length" and thinking["message"]["content"] is None
    assert thinking["message"]["reasoning"] == "<think>" * 23
    closed, _ = chat(stack, END_THINK, {"enable_thinking": False})  # the grammar from the first token
    assert "reasoning" not in closed["message"] and closed["message"]["content"].startswith("{")
