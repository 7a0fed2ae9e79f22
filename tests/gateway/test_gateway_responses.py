"""OpenAI's Responses API (/v1/responses) against a real worker, through the official ``openai``
client: each response holds what the chat completion it means answers (greedy, so the same
tokens), streamed events concatenate to the whole response, and what is not served is refused
by name."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gateway_support import MODEL_NAME, FakeWorker, Stack, gateway_settings, running_gateway
from yutu.protocol.generate import TokenDelta

from services.gateway.errors import ApiError
from services.gateway.responses_api import ResponsesRequest, renamed


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(stack: Stack, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_completion_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    reply = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


CONVERSATION = [
    {"role": "developer", "content": [{"type": "input_text", "text": "Answer briefly."}]},
    {
        "role": "user",
        "content": [{"type": "input_text", "text": "Once upon"}, {"type": "input_text", "text": " a time"}],
    },
    {"role": "assistant", "content": [{"type": "output_text", "text": "there was"}]},
    {"type": "message", "role": "user", "content": "and then?"},
]
AS_CHAT = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": "Once upon a time"},
    {"role": "assistant", "content": "there was"},
    {"role": "user", "content": "and then?"},
]


@pytest.mark.parametrize(
    ("inputs", "instructions", "messages"),
    [
        ("Once upon a time", None, [{"role": "user", "content": "Once upon a time"}]),
        (
            "Tell me",
            "You are terse.",
            [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me"}],
        ),
        (CONVERSATION, None, AS_CHAT),
    ],
    ids=["text", "instructions", "conversation"],
)
def test_a_response_holds_what_its_chat_completion_answers(
    stack: Stack, client: openai.OpenAI, inputs: Any, instructions: str | None, messages: list[dict[str, Any]]
) -> None:
    for max_tokens in (6, 40):
        ref = chat(stack, messages, max_tokens)
        (choice,) = ref["choices"]
        response = client.responses.create(
            model=MODEL_NAME,
            input=inputs,
            instructions=instructions,
            max_output_tokens=max_tokens,
            temperature=0,
        )
        assert (
            response.object == "response" and response.id.startswith("resp_") and response.model == MODEL_NAME
        )
        assert response.output_text == choice["message"]["content"]
        (item,) = response.output
        assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
        incomplete = choice["finish_reason"] == "length"
        assert response.status == item.status == ("incomplete" if incomplete else "completed")
        assert (response.incomplete_details is not None) is incomplete
        usage = response.usage
        assert usage is not None
        assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
            ref["usage"]["prompt_tokens"], ref["usage"]["completion_tokens"], ref["usage"]["total_tokens"],
        )  # fmt: skip
        assert usage.output_tokens_details.reasoning_tokens == 0
        assert response.store is False and response.instructions == instructions
    assert response.max_output_tokens == 40 and response.temperature == 0


def test_streamed_events_make_the_whole_response(stack: Stack, client: openai.OpenAI) -> None:
    """The typed events in OpenAI's order, numbered from 0, whose deltas concatenate to the text of
    the response made whole; the last event carries that response; no [DONE]."""
    for max_tokens in (5, 60):
        whole = client.responses.create(model=MODEL_NAME, input="Once upon a time", max_output_tokens=max_tokens,
                                        temperature=0)  # fmt: skip
        events = list(client.responses.create(model=MODEL_NAME, input="Once upon a time",
                                              max_output_tokens=max_tokens, temperature=0, stream=True))  # fmt: skip
        types = [e.type for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]  # fmt: skip
        assert types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
        final = f"response.{whole.status}"
        assert types[4 + len(deltas) :] == ["response.output_text.done", "response.content_part.done",
                                            "response.output_item.done", final]  # fmt: skip
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        text = "".join(d.delta for d in deltas)
        assert text == whole.output_text == events[-3 - 1].text
        last = events[-1].response
        assert last.output_text == text and last.status == whole.status and last.id == events[0].response.id
        assert last.usage is not None and whole.usage is not None
        assert last.usage.output_tokens == whole.usage.output_tokens
        assert events[-2].item.status == whole.output[0].status
    raw = httpx.post(f"{stack.base_url}/v1/responses", timeout=60,
                     json={"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 3, "stream": True})  # fmt: skip
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in raw.text and raw.text.startswith("event: response.created\ndata: ")
    assert raw.headers["x-yutu-decode"]


def test_a_json_schema_format_is_the_chat_completions(stack: Stack, client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
              "additionalProperties": False}  # fmt: skip
    response = client.responses.create(
        model=MODEL_NAME, input="A name:", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
    )  # fmt: skip
    ref = chat(stack, [{"role": "user", "content": "A name:"}], 40,
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})  # fmt: skip
    assert response.output_text == ref["choices"][0]["message"]["content"]
    assert set(json.loads(response.output_text)) == {"name"}
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
            "tools",
            "tools are not supported",
        ),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        (
            {"input": [{"type": "function_call_output", "role": "user", "content": "x"}]},
            "input.0.type",
            "function_call_output",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "text": "x"}]}]},
            "input.0.content.0",
            "input_image",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "'tool'"),
        ({"input": []}, "input", "no message"),
        ({"max_output_tokens": 100_000}, "max_output_tokens", "max_output_tokens"),
        ({"truncation": "auto"}, "truncation", "auto"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format", "name and a schema"),
        ({"temperature": 3}, "temperature", ""),
    ],
)
def test_what_is_not_served_is_refused_by_name(
    stack: Stack, change: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4, **change}
    reply = httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"]
    assert "max_completion_tokens" not in error["message"] and "messages" not in (error["param"] or "")


def test_no_response_is_stored(stack: Stack) -> None:
    reply = httpx.get(f"{stack.base_url}/v1/responses/resp_123", timeout=10)
    assert reply.status_code == 404
    assert "stores no responses" in reply.json()["error"]["message"]


def test_errors_of_the_chat_path_take_the_responses_names() -> None:
    plain = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    told = ResponsesRequest.model_validate({"model": "m", "input": "x", "instructions": "be brief"})
    err = renamed(ApiError("max_completion_tokens=9 is too many", param="max_completion_tokens"), plain)
    assert (err.message, err.param, err.status) == (
        "max_output_tokens=9 is too many",
        "max_output_tokens",
        400,
    )
    assert renamed(ApiError("bad", param="messages.1.content"), plain).param == "input.1.content"
    assert renamed(ApiError("bad", param="messages.1.content"), told).param == "input.0.content"
    assert renamed(ApiError("bad", param="messages.0"), told).param == "instructions"
    assert renamed(ApiError("bad", param="messages"), told).param == "input"
    assert renamed(ApiError("bad", param="model", code="model_not_found"), told).code == "model_not_found"


async def test_a_client_gone_mid_stream_aborts_the_request(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    """The client hangs up after the first delta: the gateway tells the worker to stop (a scripted
    worker: a real one may well have finished by then)."""
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, gw):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            body = {"model": MODEL_NAME, "input": "hi", "stream": True}
            async with client.stream("POST", "/v1/responses", json=body) as resp:
                ident, req = await fake_worker.next_request()
                await fake_worker.send(ident, TokenDelta(req.request_id, [376], num_prompt_tokens=9))
                lines = resp.aiter_lines()
                while "response.output_text.delta" not in await anext(lines):
                    pass
            await fake_worker.wait_abort(req.request_id)
        await asyncio.sleep(0.1)
        assert sum(w.in_flight for w in gw.pool.workers.values()) == 0
