"""The gateway's control logic against scripted workers on real sockets and a real Redis.

Aborts on client disconnect and on stop strings, a worker dying mid-request, worker failures
mapped to statuses, least-loaded picking and n>1 seeds: what a real engine cannot be steered into.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import httpx
from gateway_support import MODEL_NAME, FakeWorker, gateway_settings, running_gateway
from yutu.engine.tokenizer import Tokenizer
from yutu.protocol.generate import GenerateRequest, RequestFailed, TokenDelta


async def first_request(*workers: FakeWorker) -> tuple[FakeWorker, bytes, GenerateRequest]:
    """The worker the gateway picked for the next request, with the request."""
    for _ in range(100):
        for w in workers:
            if not w.requests.empty():
                ident, req = w.requests.get_nowait()
                return w, ident, req
        await asyncio.sleep(0.05)
    raise AssertionError("no worker got a request")


def sse_events(body: str) -> list[str]:
    return [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]


async def test_stream_detokenizes_and_stop_string_aborts_the_worker(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    tok = Tokenizer.from_dir(tiny_model)
    ids = tok.encode("Hello, world! 你好 STOP never", add_special_tokens=False)
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 50, "stream": True, "stop": [" STOP"],
                    "stream_options": {"include_usage": True}}  # fmt: skip
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                ident, req = await fake_worker.next_request()
                assert req.prompt_token_ids == tok.encode("hi")
                assert req.sampling["max_tokens"] == 50 and req.sampling["stop_token_ids"] == []
                for i, t in enumerate(ids):
                    await fake_worker.send(
                        ident, TokenDelta(req.request_id, [t], num_prompt_tokens=2, num_cached_tokens=0)
                    )
                    if i == 3:
                        await asyncio.sleep(0.05)  # let some chunks out before the rest
                text = "".join([chunk async for chunk in resp.aiter_text()])
            await fake_worker.wait_abort(req.request_id)
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    pieces = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(pieces) == "Hello, world! 你好"
    last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", " STOP")
    assert chunks[-1]["choices"] == []
    n_stop = min(k for k in range(len(ids) + 1) if " STOP" in tok.decode(ids[:k]))
    assert chunks[-1]["usage"]["completion_tokens"] == n_stop  # tokens up to the one completing " STOP"
    assert chunks[-1]["usage"]["prompt_tokens"] == 2


async def test_client_disconnect_aborts_stream_and_non_stream(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, gw):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=chat) as resp:
                ident, req = await fake_worker.next_request()
                await fake_worker.send(ident, TokenDelta(req.request_id, [376], num_prompt_tokens=9))
                lines = resp.aiter_lines()
                while "Hello" not in await anext(lines):
                    pass
            # The client hung up mid-stream: the gateway tells the worker to stop.
            await fake_worker.wait_abort(req.request_id)

            non_stream = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 5}
            task = asyncio.create_task(client.post("/v1/completions", json=non_stream, timeout=0.5))
            ident, req2 = await fake_worker.next_request()
            try:
                await task
            except httpx.ReadTimeout:
                pass
            await fake_worker.wait_abort(req2.request_id)
        await asyncio.sleep(0.1)
        assert sum(w.in_flight for w in gw.pool.workers.values()) == 0


async def test_worker_death_mid_request_moves_it_or_is_an_error_not_a_hang(
    tiny_model: Path, redis_url: str, registry_prefix: str
) -> None:
    w1 = await FakeWorker(redis_url, registry_prefix).start()
    w2 = await FakeWorker(redis_url, registry_prefix).start()
    settings = replace(gateway_settings(tiny_model, redis_url, registry_prefix), failover_wait_s=0.5)
    try:
        async with running_gateway(settings, 2) as (url, gw):
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 5, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    dead, ident, req = await first_request(w1, w2)
                    alive = w2 if dead is w1 else w1
                    await dead.send(ident, TokenDelta(req.request_id, [376], num_prompt_tokens=2))
                    await dead.die()
                    # The stream moves to the other worker with the token it has, under an id of its own.
                    ident, moved = await alive.next_request()
                    assert moved.request_id == req.request_id + "-m1" and moved.generated == [376]
                    assert moved.prompt_token_ids == req.prompt_token_ids
                    await alive.send(
                        ident,
                        TokenDelta(moved.request_id, [376], finish_reason="length", num_prompt_tokens=2),
                    )
                    text = "".join([chunk async for chunk in resp.aiter_text()])
                events = sse_events(text)
                assert events[-1] == "[DONE]"
                chunks = [json.loads(e) for e in events[:-1]]
                assert not [c for c in chunks if "error" in c], chunks
                assert [c["choices"][0]["text"] for c in chunks if c["choices"]][:2] == ["Hello", "Hello"]
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                # The dead worker is no longer picked although its record lives on: the other serves.
                task = asyncio.create_task(client.post("/v1/completions", json={**body, "stream": False}))
                ident, req = await alive.next_request()
                await alive.send(
                    ident, TokenDelta(req.request_id, [376], finish_reason="length", num_prompt_tokens=2)
                )
                resp2 = await task
                assert resp2.status_code == 200 and resp2.json()["choices"][0]["text"] == "Hello"
                # A request on a worker that dies, none left to take it within the failover wait: a 503.
                task = asyncio.create_task(client.post("/v1/completions", json={**body, "stream": False}))
                ident, req = await alive.next_request()
                await alive.die()
                resp3 = await task
                assert not gw.pool.usable()
                err = resp3.json()["error"]
                assert resp3.status_code == 503 and err["type"] == "service_unavailable"
                assert "disconnected" in err["message"] and "could not be moved" in err["message"], err
                assert "waited 0.5s" in err["message"], err
                resp3 = await client.post("/v1/completions", json={**body, "stream": False})
                assert resp3.status_code == 503 and resp3.json()["error"]["type"] == "service_unavailable"
                assert (await client.get("/ready")).status_code == 503
    finally:
        await w1.close()
        await w2.close()


async def test_worker_failures_map_to_statuses_and_draining_workers_finish_requests(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    settings = gateway_settings(tiny_model, redis_url, registry_prefix, registry_ttl_s=0.6)
    async with running_gateway(settings) as (url, gw):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 5}
            for kind, status in [
                ("request_too_large", 413),
                ("invalid_request_error", 400),
                ("internal_error", 500),
            ]:
                task = asyncio.create_task(client.post("/v1/completions", json=body))
                ident, req = await fake_worker.next_request()
                await fake_worker.send(ident, RequestFailed(req.request_id, kind, f"worker says {kind}"))
                resp = await task
                assert resp.status_code == status
                assert resp.json()["error"] == {
                    "message": f"worker says {kind}",
                    "type": kind,
                    "param": None,
                    "code": None,
                }
            # The worker deregisters (it drains) while a request is in flight: that request still
            # completes; the worker stays in the pool, unlisted, until it is idle past the grace time.
            task = asyncio.create_task(client.post("/v1/completions", json=body))
            ident, req = await fake_worker.next_request()
            await fake_worker.registration.close()
            await asyncio.sleep(0.5)  # a few registry polls (every 0.2 s) see it gone
            worker = gw.pool.workers[fake_worker.instance_id]
            assert worker.unlisted_since is not None
            await fake_worker.send(
                ident, TokenDelta(req.request_id, [376], finish_reason="length", num_prompt_tokens=1)
            )
            resp = await asyncio.wait_for(task, 5)
            assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
            await asyncio.sleep(1.2)  # idle and unlisted for longer than the grace (the registry TTL)
            assert gw.pool.workers == {}


async def test_least_loaded_pick_and_n_seeds(tiny_model: Path, redis_url: str, registry_prefix: str) -> None:
    w1 = await FakeWorker(redis_url, registry_prefix).start()
    w2 = await FakeWorker(redis_url, registry_prefix).start()
    try:
        async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix), 2) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 3, "n": 2, "seed": 41, "temperature": 0.7,
                        "top_k": 5, "ignore_eos": True, "stop_token_ids": [7]}  # fmt: skip
                task = asyncio.create_task(client.post("/v1/completions", json=body))
                # One choice on each worker (both idle, then the other has one in flight).
                (i1, r1), (i2, r2) = await w1.next_request(), await w2.next_request()
                got = sorted([r1, r2], key=lambda r: r.sampling["seed"])
                assert [r.sampling["seed"] for r in got] == [41, 42]
                for r in got:
                    assert {k: r.sampling[k] for k in ("temperature", "top_k", "ignore_eos", "stop_token_ids")} == {
                        "temperature": 0.7, "top_k": 5, "ignore_eos": True, "stop_token_ids": [7]}  # fmt: skip
                # Answer the second choice first: the response is still in index order.
                words = {41: [376], 42: [16, 7]}
                for ident, r, w in sorted([(i1, r1, w1), (i2, r2, w2)], key=lambda x: -x[1].sampling["seed"]):
                    reason = "stop" if r.sampling["seed"] == 42 else "length"
                    await w.send(ident, TokenDelta(r.request_id, words[r.sampling["seed"]], finish_reason=reason,
                                                   num_prompt_tokens=2, num_cached_tokens=0))  # fmt: skip
                resp = (await task).json()
                assert [c["index"] for c in resp["choices"]] == [0, 1]
                assert [c["text"] for c in resp["choices"]] == ["Hello", ",#"]  # a stop token is kept (vLLM)
                assert [c["finish_reason"] for c in resp["choices"]] == ["length", "stop"]
                assert resp["choices"][1]["stop_reason"] == 7
                assert resp["usage"]["completion_tokens"] == 3 and resp["usage"]["prompt_tokens"] == 2
    finally:
        await w1.close()
        await w2.close()


async def test_no_worker_is_503_and_models_marks_demo(
    tiny_model: Path, redis_url: str, registry_prefix: str
) -> None:
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix), 0) as (url, gw):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/ready")).status_code == 503
            resp = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
            assert resp.status_code == 503
            assert resp.json()["error"]["type"] == "service_unavailable"
            assert "no worker serving model 'tiny'" in resp.json()["error"]["message"]
            demo = await FakeWorker(redis_url, registry_prefix, max_model_len=99, demo=True).start()
            try:
                for _ in range(50):
                    if (await client.get("/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.1)
                models = (await client.get("/v1/models")).json()["data"]
                assert [m["id"] for m in models] == [MODEL_NAME]
                assert models[0]["max_model_len"] == 99
                assert models[0]["yutu_note"].startswith("random weights: text is meaningless")
            finally:
                await demo.close()
