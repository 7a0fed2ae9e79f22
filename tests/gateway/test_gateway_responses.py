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
from services.gateway.responses_api import ResponsesRequest, chat_request, renamed


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
        assert response.store is True and response.instructions == instructions
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
        assert all(e.logprobs == [] for e in events if e.type.startswith("response.output_text."))  # required
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


PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "name": "weather", "description": "The weather in a city", "parameters": PARAMETERS},
    {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
]  # fmt: skip
AS_CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
ASKED = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.mark.parametrize(
    ("choice", "chat_choice", "parallel"),
    [
        (
            {"type": "function", "name": "weather"},
            {"type": "function", "function": {"name": "weather"}},
            True,
        ),
        ("required", "required", False),
    ],
    ids=["named", "required"],
)
def test_function_calls_are_the_chat_completions(
    stack: Stack, client: openai.OpenAI, choice: Any, chat_choice: Any, parallel: bool
) -> None:
    """A named function or "required": the response's function_call items are the chat completion's
    tool calls (same request, greedy), whole and streamed as the Responses API streams them."""
    ref = chat(stack, ASKED, 80, tools=AS_CHAT_TOOLS, tool_choice=chat_choice, parallel_tool_calls=parallel)
    (want,) = ref["choices"][0]["message"]["tool_calls"]
    args: dict[str, Any] = dict(model=MODEL_NAME, input=ASKED, tools=TOOLS, tool_choice=choice, max_output_tokens=80,
                                temperature=0, parallel_tool_calls=parallel)  # fmt: skip
    response = client.responses.create(**args)
    (call,) = response.output
    assert call.type == "function_call" and call.status == "completed" and response.status == "completed"
    assert (call.name, call.arguments) == (want["function"]["name"], want["function"]["arguments"])
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    assert response.output_text == ""
    assert [t.name for t in response.tools] == ["weather", "now"] and response.parallel_tool_calls is parallel
    assert response.usage is not None and response.usage.output_tokens == ref["usage"]["completion_tokens"]
    events = list(client.responses.create(**args, stream=True))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     *[d.type for d in deltas], "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, done, item_done, completed = events[2], events[-3], events[-2], events[-1]
    assert (
        added.item.type == "function_call"
        and added.item.status == "in_progress"
        and added.item.arguments == ""
    )
    assert "".join(d.delta for d in deltas) == done.arguments == call.arguments
    assert all(d.item_id == added.item.id == done.item_id == item_done.item.id for d in deltas)
    assert (item_done.item.name, item_done.item.arguments, item_done.item.status) == (call.name, call.arguments,
                                                                                     "completed")  # fmt: skip
    assert [(o.type, o.name, o.arguments) for o in completed.response.output] == [("function_call", call.name,
                                                                                  call.arguments)]  # fmt: skip


def test_the_turn_after_a_call_is_the_chat_completions(stack: Stack, client: openai.OpenAI) -> None:
    """An agent loop: the first response's function call goes back as input with its output; the
    next response is the chat completion of the same conversation (tool_calls and a tool message)."""
    first = client.responses.create(model=MODEL_NAME, input=ASKED, tools=TOOLS, max_output_tokens=80, temperature=0,
                                    tool_choice={"type": "function", "name": "weather"})  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call"
    turn = [*ASKED, call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                                         "output": "3 C, sunny"}]  # fmt: skip
    for max_tokens in (
        6,
        30,
    ):  # as an agent loop that stores nothing asks (the reasoning's text comes anyway)
        then = client.responses.create(model=MODEL_NAME, input=turn, tools=TOOLS, tool_choice="none", store=False,
                                       max_output_tokens=max_tokens, temperature=0,
                                       include=["reasoning.encrypted_content"])  # fmt: skip
        messages = [*ASKED, {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "3 C, sunny"}]  # fmt: skip
        ref = chat(stack, messages, max_tokens, tools=AS_CHAT_TOOLS, tool_choice="none")
        assert then.output_text == ref["choices"][0]["message"]["content"]
        assert then.usage is not None and then.usage.input_tokens == ref["usage"]["prompt_tokens"]
        assert then.status == (
            "incomplete" if ref["choices"][0]["finish_reason"] == "length" else "completed"
        )


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'web_search'"),
        ({"tools": [{"type": "function"}]}, "tools.0.name", "needs a name"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools.0.name", "pattern"),
        (
            {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools"}},
            "tool_choice",
            "'allowed_tools'",
        ),  # fmt: skip
        (
            {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
            "tool_choice",
            "not among tools",
        ),  # fmt: skip
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"conversation": "conv_1"}, "conversation", "Conversations API"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not found"),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input.0.type", "file_search_call"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input.0.call_id",
            "call_id",
        ),
        (
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}
                ]
            },
            "input.0.output.0",
            "input_image",
        ),  # fmt: skip
        (
            {"input": [{"role": "user", "content": "x"}, {"type": "reasoning", "summary": []}]},
            "input",
            "reasoning",
        ),
        (
            {"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "x"}]},
            "input.1",
            "reasoning",
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
        (
            {"include": ["reasoning.encrypted_content", "file_search_call.results"]},
            "include.1",
            "file_search",
        ),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format", "name and a schema"),
        ({"temperature": 3}, "temperature", ""),
        ({"top_logprobs": 21}, "top_logprobs", "20"),
        (
            {"include": ["message.output_text.logprobs"], "tools": [{"type": "function", "name": "f"}]},
            "include",
            'tool_choice "none"',
        ),
        ({"top_logprobs": 2, "tools": [{"type": "function", "name": "f"}]}, "top_logprobs", "all text"),
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


def test_logprobs_are_the_chat_completions(stack: Stack, client: openai.OpenAI) -> None:
    """The answer's tokens' logprobs, as the chat completion of the same request gives them (greedy:
    the same tokens), in the output_text part; streamed, each delta carries its tokens' and the
    done event all of them. top_logprobs above 0 asks for them too; nothing asked, none come."""
    ref = chat(stack, [{"role": "user", "content": "Once upon a time"}], 12, logprobs=True, top_logprobs=2)
    want = ref["choices"][0]["logprobs"]["content"]
    assert len(want) == ref["usage"]["completion_tokens"] and all(len(t["top_logprobs"]) == 2 for t in want)
    for asked in ({"include": ["message.output_text.logprobs"], "top_logprobs": 2}, {"top_logprobs": 2}):
        response = client.responses.create(model=MODEL_NAME, input="Once upon a time", max_output_tokens=12,
                                           temperature=0, **asked)  # fmt: skip
        (part,) = response.output[0].content  # type: ignore[union-attr]
        got = [lp.model_dump() for lp in part.logprobs or []]  # type: ignore[union-attr]
        assert [t["token"] for t in got] == [t["token"] for t in want]
        assert [t["logprob"] for t in got] == pytest.approx([t["logprob"] for t in want], abs=1e-4)
        assert [[a["token"] for a in t["top_logprobs"]] for t in got] == [
            [a["token"] for a in t["top_logprobs"]] for t in want
        ]
    events = list(client.responses.create(model=MODEL_NAME, input="Once upon a time", max_output_tokens=12,
                                          temperature=0, stream=True, top_logprobs=2))  # fmt: skip
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp.token for d in deltas for lp in d.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert streamed == [lp.token for lp in done.logprobs] == [t["token"] for t in want]
    assert [lp.token for lp in events[-1].response.output[0].content[0].logprobs] == streamed
    plain = client.responses.create(
        model=MODEL_NAME, input="Once upon a time", max_output_tokens=4, temperature=0
    )
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


def test_errors_of_the_chat_path_take_the_responses_names() -> None:
    def origins(**fields: Any) -> list[str]:
        return chat_request(ResponsesRequest.model_validate({"model": "m", **fields})).origins

    plain = origins(input=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    told = origins(input="x", instructions="be brief")
    err = renamed(ApiError("max_completion_tokens=9 is too many", param="max_completion_tokens"), plain)
    assert (err.message, err.param, err.status) == (
        "max_output_tokens=9 is too many",
        "max_output_tokens",
        400,
    )
    assert renamed(ApiError("bad", param="messages.1.content"), plain).param == "input.1.content"
    assert renamed(ApiError("bad", param="messages.1.content"), told).param == "input"
    assert renamed(ApiError("bad", param="messages.0"), told).param == "instructions"
    assert renamed(ApiError("bad", param="messages"), told).param == "input"
    assert renamed(ApiError("bad", param="model", code="model_not_found"), told).code == "model_not_found"
    # two calls and their outputs: four items, three chat messages
    calls = origins(input=[CONVERSATION[1], *CALLS, *OUTPUTS])
    assert calls == ["input.0", "input.1", "input.3", "input.4"]
    assert renamed(ApiError("bad", param="messages.2.content"), calls).param == "input.3.content"


CALLS = [
    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Oslo", "unit": "c"}',
     "id": "fc_1", "status": "completed"},
    {"type": "function_call", "call_id": "call_2", "name": "now", "arguments": "{}"},
]  # fmt: skip
OUTPUTS = [
    {"type": "function_call_output", "call_id": "call_1", "output": "3 C"},
    {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
]
CHAT_CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo", "unit": "c"}'}},
    {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
]  # fmt: skip


def test_input_items_are_the_chat_messages_an_agent_loop_means() -> None:
    """Function calls join the assistant message before them, outputs are tool messages, a
    reasoning item's text is the next assistant turn's reasoning_content."""
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "Look it up."}]}  # fmt: skip
    said = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
            "content": [{"type": "output_text", "text": "Let me see.", "annotations": [], "logprobs": []}]}  # fmt: skip
    request = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": [CONVERSATION[1], thought, said, *CALLS, *OUTPUTS, {"role": "user", "content": "and?"}],
        }
    )
    messages = [m.model_dump(exclude_none=True) for m in chat_request(request).request.messages]
    assert messages == [
        {"role": "user", "content": "Once upon a time"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "reasoning_content": "Look it up.",
            "tool_calls": CHAT_CALLS,
        },
        {"role": "tool", "content": "3 C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2"},
        {"role": "user", "content": "and?"},
    ]
    # calls with no message before them, after a reasoning item (its summary's text): a message of their own
    summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Short."}]}
    request = ResponsesRequest.model_validate({"model": "m", "input": [CONVERSATION[1], summary, *CALLS]})
    messages = [m.model_dump(exclude_none=True) for m in chat_request(request).request.messages]
    assert messages[1] == {"role": "assistant", "reasoning_content": "Short.", "tool_calls": CHAT_CALLS}


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
