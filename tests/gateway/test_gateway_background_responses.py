"""Background responses (services/gateway/background.py): answered ``queued`` at once, made after
the request, followed and cancelled from any gateway of the deployment, failed -- never left
running -- when the gateway running them stops or dies.

Against a real worker through the official ``openai`` client (the output equals the same
response made in the foreground, greedy), and against a worker whose tokens the test sends
(``FakeWorker``), so that a response is held running for as long as a test needs and the abort a
cancel must send to the worker is seen.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from gateway_support import (
    MODEL_NAME,
    FakeWorker,
    Stack,
    gateway_settings,
    gateway_url,
    running_gateway,
    start_gateway,
)
from yutu.protocol.generate import GenerateRequest, RequestFailed, TokenDelta

ENDED = ("completed", "incomplete", "failed", "cancelled")


async def until_status(
    http: httpx.AsyncClient, rid: str, statuses: tuple[str, ...] = ENDED, timeout_s: float = 15
) -> dict[str, Any]:
    """The response once its status is one of ``statuses``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await http.get(f"/v1/responses/{rid}")
        assert got.status_code == 200, got.text
        if got.json()["status"] in statuses:
            return got.json()
        assert time.monotonic() < deadline, f"{rid} still {got.json()['status']}, not {statuses}"
        await asyncio.sleep(0.05)  # polling the API, as a client of background mode does


async def started(
    http: httpx.AsyncClient, fake_worker: FakeWorker, **body: Any
) -> tuple[dict[str, Any], bytes, GenerateRequest]:
    """A background response queued, and its request at the worker."""
    reply = await http.post(
        "/v1/responses", json={"model": MODEL_NAME, "input": "hi", "background": True, **body}
    )
    assert reply.status_code == 200, reply.text
    ident, req = await fake_worker.next_request()
    return reply.json(), ident, req


def test_a_background_response_equals_the_foreground_one(stack: Stack) -> None:
    """Through the openai client: queued at once, then polled until it is the response the same
    request makes in the foreground (greedy: the same text and tokens)."""
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    asked = {"model": MODEL_NAME, "input": "Once upon a time", "max_output_tokens": 12, "temperature": 0}
    made = client.responses.create(background=True, **asked)  # type: ignore[arg-type]
    assert made.status == "queued" and made.background is True and made.output == [] and made.store is True
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(made.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ref = client.responses.create(**asked)  # type: ignore[arg-type]
    assert got.status == ref.status == "incomplete" and got.background is True and ref.background is False
    assert got.output_text == ref.output_text and got.usage is not None and ref.usage is not None
    assert (got.usage.input_tokens, got.usage.output_tokens) == (
        ref.usage.input_tokens,
        ref.usage.output_tokens,
    )
    then = client.responses.create(previous_response_id=made.id, **{**asked, "input": "and then?"})  # type: ignore[arg-type]
    assert then.usage is not None and then.usage.input_tokens > got.usage.input_tokens  # its turn was kept
    streamed = list(client.responses.create(background=True, stream=True, **asked))  # type: ignore[call-overload]
    assert streamed[0].type == "response.created" and streamed[0].response.status == "queued"
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    assert streamed[-1].type == "response.incomplete" and streamed[-1].response.output_text == ref.output_text
    resumed = list(client.responses.retrieve(streamed[-1].response.id, stream=True, starting_after=2))
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in streamed[3:]]
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a response that is incomplete"):
        client.responses.cancel(made.id)
    with pytest.raises(openai.BadRequestError, match="background true"):
        client.responses.cancel(ref.id)


async def test_it_runs_queued_then_in_progress_then_ends(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, gw):
        assert gw.background is not None
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            made, ident, req = await started(http, fake_worker, max_output_tokens=3)
            assert made["status"] == "queued" and made["background"] is True and made["error"] is None
            running = await until_status(http, made["id"], ("in_progress",))
            assert running["output"] == [] and gw.background.info() == {"running": [made["id"]]}
            reply = await http.post("/v1/responses", json={"model": MODEL_NAME, "input": "next",
                                                           "previous_response_id": made["id"]})  # fmt: skip
            assert (
                reply.status_code == 400
            )  # it cannot be continued while it runs and reply.json()["error"]["param"] == "previous_response_id"
            assert "in_progress" in reply.json()["error"]["message"]
            await fake_worker.send(ident, TokenDelta(req.request_id, [376, 377], num_prompt_tokens=9))
            await fake_worker.send(ident, TokenDelta(req.request_id, [378], finish_reason="length",
                                                     num_prompt_tokens=9))  # fmt: skip
            done = await until_status(http, made["id"])
            assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 3
            assert done["output"][0]["content"][0]["text"] == gw.tokenizer.decode([376, 377, 378])
            assert {k: v for k, v in done.items() if k not in ("status", "output", "usage", "incomplete_details")} \
                == {k: v for k, v in made.items() if k not in ("status", "output", "usage", "incomplete_details")}  # fmt: skip
            assert gw.background.info() == {"running": []}
            record = json.loads(
                redis.Redis.from_url(redis_url).get(f"{registry_prefix}:response:{made['id']}") or b""
            )
            assert record["runner"] is None and record["response"] == done


async def test_a_cancel_stops_the_generation(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    """Cancelled at once, the worker told to drop it; cancelling again answers the same; a
    running response deleted is dropped at the worker too."""
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, gw):
        assert gw.background is not None
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            made, ident, req = await started(http, fake_worker, max_output_tokens=50)
            await fake_worker.send(ident, TokenDelta(req.request_id, [376], num_prompt_tokens=9))
            cancelled = await http.post(f"/v1/responses/{made['id']}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            await fake_worker.wait_abort(req.request_id)
            assert (await http.get(f"/v1/responses/{made['id']}")).json() == cancelled.json()
            again = await http.post(f"/v1/responses/{made['id']}/cancel")
            assert again.status_code == 200 and again.json() == cancelled.json()
            for _ in range(100):
                if not gw.background.tasks:
                    break
                await asyncio.sleep(0.02)
            assert gw.background.tasks == {}

            made, _, req = await started(http, fake_worker, max_output_tokens=50)
            assert (await http.delete(f"/v1/responses/{made['id']}")).status_code == 200
            await fake_worker.wait_abort(req.request_id)
            assert (await http.get(f"/v1/responses/{made['id']}")).status_code == 404
            assert (await http.post(f"/v1/responses/{made['id']}/cancel")).status_code == 404


async def test_another_gateway_follows_and_cancels_it(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    settings = gateway_settings(tiny_model, redis_url, registry_prefix)
    other = gateway_settings(tiny_model, redis_url, registry_prefix)
    async with running_gateway(settings) as (url, gw), running_gateway(other) as (other_url, _):
        assert gw.background is not None
        async with httpx.AsyncClient(base_url=url, timeout=30) as http, \
                httpx.AsyncClient(base_url=other_url, timeout=30) as there:  # fmt: skip
            made, ident, req = await started(http, fake_worker, max_output_tokens=50)
            assert (await until_status(there, made["id"], ("in_progress",)))["id"] == made["id"]
            cancelled = await there.post(f"/v1/responses/{made['id']}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            await fake_worker.wait_abort(req.request_id)  # the gateway running it saw the flag
            for _ in range(100):
                if not gw.background.tasks:
                    break
                await asyncio.sleep(0.02)
            assert gw.background.tasks == {}
            assert (await http.get(f"/v1/responses/{made['id']}")).json()["status"] == "cancelled"


async def test_a_gateway_that_stops_fails_what_it_runs(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            made, _, req = await started(http, fake_worker, max_output_tokens=50)
            await until_status(http, made["id"], ("in_progress",))
    await fake_worker.wait_abort(req.request_id)
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            got = (await http.get(f"/v1/responses/{made['id']}")).json()
    assert got["status"] == "failed" and got["error"]["code"] == "server_error"
    assert "stopped before it finished" in got["error"]["message"]


async def test_a_gateway_that_died_leaves_it_failed(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker, tmp_path: Path
) -> None:
    """Killed outright: once its registry record has expired, the gateway asked says failed."""
    proc = start_gateway(tmp_path, tiny_model, redis_url, registry_prefix, "--registry-ttl", "1")
    try:
        dead_url = await asyncio.to_thread(gateway_url, redis_url, registry_prefix, proc)
        async with httpx.AsyncClient(base_url=dead_url, timeout=30) as http:
            for _ in range(200):  # until it has the (fake) worker
                if (await http.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            made, _, _ = await started(http, fake_worker, max_output_tokens=50)
            await until_status(http, made["id"], ("in_progress",))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        runner = json.loads(
            redis.Redis.from_url(redis_url).get(f"{registry_prefix}:response:{made['id']}") or b""
        )
        async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                got = await until_status(http, made["id"], timeout_s=10)
                assert got["status"] == "failed" and runner["runner"] in got["error"]["message"]
                cancel = await http.post(f"/v1/responses/{made['id']}/cancel")
                assert cancel.status_code == 400 and "failed" in cancel.json()["error"]["message"]
                streamed = sse(
                    (await http.get(f"/v1/responses/{made['id']}", params={"stream": "true"})).text
                )
                assert [e["type"] for e in streamed] == [
                    "response.created",
                    "response.in_progress",
                    "response.failed",
                ]
                assert streamed[-1]["response"] == got and streamed[-1]["sequence_number"] == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def test_what_background_needs_is_asked_for(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"model": MODEL_NAME, "input": "hi", "background": True, "store": False}
            reply = await http.post("/v1/responses", json=body)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "store"
            assert fake_worker.requests.empty()
    settings = gateway_settings(tiny_model, redis_url, registry_prefix, responses_ttl_s=0)
    async with running_gateway(settings, connected_workers=0) as (url, gw):
        assert gw.background is None
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            reply = await http.post(
                "/v1/responses", json={"model": MODEL_NAME, "input": "x", "background": True}
            )
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "background"
            assert (await http.post("/v1/responses/resp_1/cancel")).status_code == 404


def sse(text: str) -> list[dict[str, Any]]:
    """The payloads of a Responses stream's events, in order."""
    return [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n") if "data: " in block]


async def read_until(lines: Any, seen: list[dict[str, Any]], kind: str) -> None:
    """Read the event stream's lines into ``seen`` until an event of type ``kind`` has come."""
    async for line in lines:
        if line.startswith("data: "):
            seen.append(json.loads(line[6:]))
            if seen[-1]["type"] == kind:
                return
    raise AssertionError(f"the stream ended before a {kind} event: {[e['type'] for e in seen]}")


async def test_its_events_stream_as_made_and_again_from_where_a_client_was(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    """background and stream: the events as they are made; GET ?stream=true&starting_after=N on
    another gateway, mid-response: the same events after N, the same end; a cancel ends a stream
    with response.cancelled."""
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, gw), \
            running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (other_url, _):  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=30) as http, \
                httpx.AsyncClient(base_url=other_url, timeout=30) as there:  # fmt: skip
            body = {
                "model": MODEL_NAME,
                "input": "hi",
                "background": True,
                "stream": True,
                "max_output_tokens": 3,
            }
            async with http.stream("POST", "/v1/responses", json=body) as posted:
                assert posted.status_code == 200 and posted.headers["content-type"].startswith(
                    "text/event-stream"
                )
                lines, seen = posted.aiter_lines(), []
                ident, req = await fake_worker.next_request()
                await read_until(lines, seen, "response.in_progress")
                assert seen[0]["type"] == "response.created" and seen[0]["response"]["status"] == "queued"
                rid = seen[0]["response"]["id"]
                await fake_worker.send(ident, TokenDelta(req.request_id, [376], num_prompt_tokens=9))
                await read_until(lines, seen, "response.output_text.delta")
                mark = seen[-1]["sequence_number"]
                async with there.stream("GET", f"/v1/responses/{rid}",
                                        params={"stream": "true", "starting_after": mark}) as resumed:  # fmt: skip
                    await fake_worker.send(ident, TokenDelta(req.request_id, [377, 378], finish_reason="length",
                                                             num_prompt_tokens=9))  # fmt: skip
                    await read_until(lines, seen, "response.incomplete")
                    rest = sse((await resumed.aread()).decode())
            assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
            assert rest == seen[mark + 1 :]
            assert seen[-1]["response"] == (await http.get(f"/v1/responses/{rid}")).json()
            text = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")
            assert text == gw.tokenizer.decode([376, 377, 378])
            whole = sse((await there.get(f"/v1/responses/{rid}", params={"stream": "true"})).text)
            assert whole == seen  # kept whole: streamed again from the start, after it ended

            made, ident, req = await started(http, fake_worker, max_output_tokens=50)
            async with there.stream(
                "GET", f"/v1/responses/{made['id']}", params={"stream": "true"}
            ) as watched:
                lines, seen = watched.aiter_lines(), []
                await read_until(lines, seen, "response.in_progress")
                assert (await http.post(f"/v1/responses/{made['id']}/cancel")).status_code == 200
                await read_until(lines, seen, "response.cancelled")
            assert seen[-1]["response"]["status"] == "cancelled"
            await fake_worker.wait_abort(req.request_id)
            for params in ({"starting_after": 1}, {"stream": "true", "starting_after": -1}):
                reply = await http.get(f"/v1/responses/{rid}", params=params)
                assert reply.status_code == 400 and reply.json()["error"]["param"] == "starting_after"


async def test_a_generation_that_fails_ends_it_failed(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    """The worker fails it mid-answer: failed with the worker's reason; its stream ends with the
    error event, then response.failed carrying what the record says."""
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            made, ident, req = await started(http, fake_worker, max_output_tokens=50)
            await fake_worker.send(ident, TokenDelta(req.request_id, [376], num_prompt_tokens=9))
            await fake_worker.send(
                ident, RequestFailed(req.request_id, "internal_error", "engine step failed")
            )
            done = await until_status(http, made["id"])
            assert done["status"] == "failed" and done["error"]["code"] == "server_error"
            assert "engine step failed" in done["error"]["message"]
            streamed = sse((await http.get(f"/v1/responses/{made['id']}", params={"stream": "true"})).text)
            assert [e["type"] for e in streamed][-2:] == ["error", "response.failed"]
            assert streamed[-1]["response"] == done
