"""Stored responses (services/gateway/response_store.py) against a real worker and a real Redis,
through the official ``openai`` client: a response made with ``store`` is retrieved as it was
answered, ``previous_response_id`` continues its conversation exactly as sending the whole
conversation does (greedy: the same tokens, the same prompt), on any gateway of the deployment;
``input_items`` lists the conversation, ``DELETE`` forgets a response, and what cannot be kept
says so."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from gateway_support import MODEL_NAME, FakeWorker, Stack, gateway_settings, running_gateway
from yutu.launcher import free_port
from yutu.protocol.generate import TokenDelta
from yutu.redis_conn import connect

from services.gateway.app import route_pattern
from services.gateway.errors import ApiError
from services.gateway.response_store import ResponseStore, StoredResponse, owner_of
from services.gateway.responses_api import ResponsesRequest, chat_request, input_items

TOOLS = [{"type": "function", "name": "weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                         "required": ["city"], "additionalProperties": False}}]  # fmt: skip
AS_CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(stack: Stack, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": messages, "max_completion_tokens": max_tokens, "temperature": 0,
            **extra}  # fmt: skip
    reply = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def respond(url: str, **body: Any) -> dict[str, Any]:
    reply = httpx.post(
        f"{url}/v1/responses", json={"model": MODEL_NAME, "temperature": 0, **body}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_stored_response_is_retrieved_as_it_was_answered(stack: Stack, client: openai.OpenAI) -> None:
    """Whole and streamed (the last event's response), byte for byte the JSON answered; kept for
    --responses-ttl (an hour by default) in the deployment's Redis."""
    made = respond(stack.base_url, input="Once upon a time", max_output_tokens=8)
    assert made["store"] is True
    got = httpx.get(f"{stack.base_url}/v1/responses/{made['id']}", timeout=10)
    assert got.status_code == 200 and got.json() == made
    assert client.responses.retrieve(made["id"]).output_text == made["output"][0]["content"][0]["text"]
    events = list(client.responses.create(model=MODEL_NAME, input="Once upon a time", max_output_tokens=8,
                                          temperature=0, stream=True))  # fmt: skip
    assert events[0].response.store is True
    final = events[-1].response
    assert final.store is True and final.output_text == made["output"][0]["content"][0]["text"]
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    ttl = redis.Redis.from_url(stack.redis_url).pttl(f"{stack.prefix}:response:{made['id']}")
    assert 3_500_000 < ttl <= 3_600_000


def test_previous_response_id_continues_the_conversation(stack: Stack, client: openai.OpenAI) -> None:
    """Three turns chained: each is the chat completion of the whole conversation so far (earlier
    instructions are not carried over, the request's own come first), whole and streamed."""
    first = client.responses.create(model=MODEL_NAME, input="Once upon a time", instructions="Answer briefly.",
                                    max_output_tokens=6, temperature=0)  # fmt: skip
    second = client.responses.create(model=MODEL_NAME, input="and then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)  # fmt: skip
    so_far = [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": first.output_text},
              {"role": "user", "content": "and then?"}]  # fmt: skip
    ref = chat(stack, so_far, 6)
    assert second.output_text == ref["choices"][0]["message"]["content"]
    assert second.usage is not None and second.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert second.previous_response_id == first.id and second.instructions is None
    third_input = [{"role": "user", "content": [{"type": "input_text", "text": "The end?"}]}]
    third = client.responses.create(model=MODEL_NAME, input=third_input, previous_response_id=second.id,
                                    instructions="Be kind.", max_output_tokens=10, temperature=0)  # fmt: skip
    messages = [{"role": "system", "content": "Be kind."}, *so_far,
                {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "The end?"}]  # fmt: skip
    ref = chat(stack, messages, 10)
    assert third.output_text == ref["choices"][0]["message"]["content"]
    assert third.usage is not None and third.usage.input_tokens == ref["usage"]["prompt_tokens"]
    events = list(client.responses.create(model=MODEL_NAME, input=third_input, previous_response_id=second.id,
                                          instructions="Be kind.", max_output_tokens=10, temperature=0,
                                          stream=True))  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == third.output_text and events[-1].response.previous_response_id == second.id


def test_an_agent_loop_sends_only_the_function_output(stack: Stack, client: openai.OpenAI) -> None:
    """A stored function call, then only its output with previous_response_id: the chat completion
    of the conversation with the call and the tool message."""
    asked = "What is the weather in Oslo?"
    first = client.responses.create(model=MODEL_NAME, input=asked, tools=TOOLS,
                                    tool_choice={"type": "function", "name": "weather"}, max_output_tokens=60,
                                    temperature=0)  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call"
    then = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, tools=TOOLS,
                                   input=[{"type": "function_call_output", "call_id": call.call_id, "output": "3 C"}],
                                   tool_choice="none", max_output_tokens=12, temperature=0)  # fmt: skip
    messages = [{"role": "user", "content": asked},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                 "function": {"name": "weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "3 C"}]  # fmt: skip
    ref = chat(stack, messages, 12, tools=AS_CHAT_TOOLS, tool_choice="none")
    assert then.output_text == ref["choices"][0]["message"]["content"]
    assert then.usage is not None and then.usage.input_tokens == ref["usage"]["prompt_tokens"]


def test_input_items_list_the_conversation(stack: Stack, client: openai.OpenAI) -> None:
    """The earlier turns' items, then the response's own, newest first by default; pages by
    after/before, as the SDK walks them."""
    first = respond(stack.base_url, input="Once upon a time", max_output_tokens=4)
    second = respond(stack.base_url, input=[{"role": "user", "content": "and then?"}], max_output_tokens=4,
                     previous_response_id=first["id"])  # fmt: skip
    items = list(client.responses.input_items.list(second["id"], order="asc", limit=1))
    said = first["output"][0]
    assert [(i.type, i.role, i.content[0].text) for i in items] == [
        ("message", "user", "Once upon a time"),
        ("message", "assistant", said["content"][0]["text"]),
        ("message", "user", "and then?"),
    ]
    assert items[1].id == said["id"] and items[0].id.startswith("msg_") and len({i.id for i in items}) == 3
    page = httpx.get(f"{stack.base_url}/v1/responses/{second['id']}/input_items", timeout=10).json()
    assert page["object"] == "list" and [i["id"] for i in page["data"]] == [i.id for i in items][::-1]
    assert (page["first_id"], page["last_id"], page["has_more"]) == (items[2].id, items[0].id, False)
    page = httpx.get(f"{stack.base_url}/v1/responses/{second['id']}/input_items",
                     params={"before": items[0].id, "limit": 1}, timeout=10).json()  # fmt: skip
    assert [i["id"] for i in page["data"]] == [items[2].id] and page["has_more"] is True
    for params, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
        reply = httpx.get(
            f"{stack.base_url}/v1/responses/{second['id']}/input_items", params=params, timeout=10
        )
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_deleted_and_unstored_responses_are_gone(stack: Stack, client: openai.OpenAI) -> None:
    """store false keeps nothing; DELETE forgets a response (a later turn keeps its own copy of the
    conversation); a response that is not there is a 404, and a 400 as previous_response_id."""
    unstored = respond(stack.base_url, input="Hi", max_output_tokens=2, store=False)
    assert unstored["store"] is False
    first = respond(stack.base_url, input="Hi", max_output_tokens=2)
    second = respond(stack.base_url, input="again", max_output_tokens=2, previous_response_id=first["id"])
    deleted = httpx.delete(f"{stack.base_url}/v1/responses/{first['id']}", timeout=10)
    assert deleted.status_code == 200 and deleted.json() == {
        "id": first["id"],
        "object": "response",
        "deleted": True,
    }
    for gone in (unstored["id"], first["id"]):
        reply = httpx.get(f"{stack.base_url}/v1/responses/{gone}", timeout=10)
        assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(
                model=MODEL_NAME, input="x", previous_response_id=gone, max_output_tokens=2
            )
        assert err.value.code == "previous_response_not_found" and err.value.param == "previous_response_id"
    assert httpx.delete(f"{stack.base_url}/v1/responses/{first['id']}", timeout=10).status_code == 404
    third = respond(stack.base_url, input="more", max_output_tokens=2, previous_response_id=second["id"])
    assert third["usage"]["input_tokens"] > second["usage"]["input_tokens"]
    reply = httpx.get(f"{stack.base_url}/v1/responses/{second['id']}", params={"stream": "true"}, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream"


async def test_another_gateway_continues_the_conversation(stack: Stack) -> None:
    """A second gateway of the same deployment (same Redis, same prefix) takes the next turn."""
    first = respond(stack.base_url, input="Once upon a time", max_output_tokens=5)
    here = respond(stack.base_url, input="and then?", max_output_tokens=5, previous_response_id=first["id"])
    async with running_gateway(gateway_settings(stack.model_dir, stack.redis_url, stack.prefix)) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = {"model": MODEL_NAME, "temperature": 0, "input": "and then?", "max_output_tokens": 5,
                    "previous_response_id": first["id"]}  # fmt: skip
            there = (await http.post("/v1/responses", json=body)).json()
            assert (await http.get(f"/v1/responses/{here['id']}")).json() == here
    assert there["output"][0]["content"][0]["text"] == here["output"][0]["content"][0]["text"]
    tokens = ("input_tokens", "output_tokens")  # the prefix cache's share aside
    assert [there["usage"][k] for k in tokens] == [here["usage"][k] for k in tokens]


async def test_a_gateway_that_keeps_none_says_so(
    tiny_model: Path, redis_url: str, registry_prefix: str
) -> None:
    settings = gateway_settings(tiny_model, redis_url, registry_prefix, responses_ttl_s=0)
    async with running_gateway(settings, connected_workers=0) as (url, gw):
        assert gw.responses is None
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            body = {"model": MODEL_NAME, "input": "x", "previous_response_id": "resp_1"}
            reply = await http.post("/v1/responses", json=body)
            assert reply.status_code == 400 and "--responses-ttl 0" in reply.json()["error"]["message"]
            reply = await http.get("/v1/responses/resp_1")
            assert reply.status_code == 404 and "keeps none" in reply.json()["error"]["message"]


async def test_a_response_that_cannot_be_kept_says_store_false(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    """The store's Redis unreachable: the answer still comes, saying it was not kept; a
    previous_response_id cannot be read (503)."""
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, gw):
        assert gw.responses is not None
        await gw.responses.close()
        gw.responses = ResponseStore(connect(f"redis://127.0.0.1:{free_port()}/0"), registry_prefix, 60)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for stream in (False, True):
                body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 1, "stream": stream}
                posted = asyncio.ensure_future(http.post("/v1/responses", json=body))
                ident, req = await fake_worker.next_request()
                await fake_worker.send(ident, TokenDelta(req.request_id, [376], finish_reason="length",
                                                         num_prompt_tokens=9))  # fmt: skip
                reply = await posted
                made = json.loads(reply.text.rsplit("data: ", 1)[1]) if stream else reply.json()
                made = made["response"] if stream else made
                assert reply.status_code == 200 and made["status"] == "incomplete" and made["store"] is False
            reply = await http.post("/v1/responses", json={**body, "previous_response_id": "resp_1"})
            assert reply.status_code == 503 and "Redis" in reply.json()["error"]["message"]


async def test_a_response_belongs_to_the_key_that_made_it(redis_url: str, registry_prefix: str) -> None:
    store = ResponseStore(connect(redis_url), registry_prefix, 60)
    try:
        mine, theirs = owner_of("Bearer key-a"), owner_of("Bearer key-b")
        assert (
            mine != theirs
            and owner_of(None) == owner_of("Basic x") == ""
            and owner_of("bearer key-a") == mine
        )
        response = {"id": "resp_owned", "output": []}
        await store.save(StoredResponse(response, [], mine))
        assert (await store.load("resp_owned", mine)) == StoredResponse(response, [], mine)
        assert await store.load("resp_owned", theirs) is None and await store.load("resp_owned", "") is None
        assert not await store.delete("resp_owned", theirs)
        assert await store.delete("resp_owned", mine) and await store.load("resp_owned", mine) is None
        away = ResponseStore(connect(f"redis://127.0.0.1:{free_port()}/0"), registry_prefix, 60)
        with pytest.raises(ApiError) as err:
            await away.load("resp_owned", mine)
        assert err.value.status == 503
        await away.close()
    finally:
        await store.close()


def test_input_items_and_the_context_of_the_next_turn() -> None:
    """A request's input as kept (ids, text as parts); the next turn's context is the items and the
    output, less a reasoning item the output ends with; its chat messages name previous_response_id."""
    body = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "assistant", "content": "Sure.", "id": "msg_given"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]})  # fmt: skip
    items = input_items(body)
    assert items[0] == {"type": "message", "role": "assistant", "id": "msg_given", "status": "completed",
                        "content": [{"type": "output_text", "text": "Sure."}]}  # fmt: skip
    assert items[1]["id"].startswith("fc_") and items[2]["id"].startswith("fco_")
    assert input_items(ResponsesRequest.model_validate({"model": "m", "input": "hi"}))[0]["content"] == [
        {"type": "input_text", "text": "hi"}
    ]
    thought = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Hm"}],
    }
    said = {"type": "message", "id": "msg_2", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Yes."}]}  # fmt: skip
    assert StoredResponse({"output": [thought, said]}, items, "").context() == [*items, thought, said]
    assert StoredResponse({"output": [said, thought]}, items, "").context() == [*items, said]
    view = chat_request(ResponsesRequest.model_validate({"model": "m", "input": "next", "instructions": "Be brief."}),
                        [*items, thought, said])  # fmt: skip
    assert view.origins == ["instructions", *["previous_response_id"] * 3, "input"]
    assert [m.role for m in view.request.messages] == ["system", "assistant", "tool", "assistant", "user"]
    assert view.request.messages[3].reasoning_content == "Hm"


def test_the_metrics_name_the_stored_response_routes() -> None:
    assert route_pattern("/v1/responses/resp_1") == "/v1/responses/{id}"
    assert route_pattern("/v1/responses/resp_1/input_items") == "/v1/responses/{id}/input_items"
    assert route_pattern("/v1/responses/resp_1/cancel") == "/v1/responses/{id}/cancel"
    assert route_pattern("/v1/nothing") == "other"
