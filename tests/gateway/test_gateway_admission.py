"""Admission control logic: the tokenizer pool and the cap on one request's choices in flight.

The pool is driven directly; the cap through a gateway in this event loop and a scripted worker
(real sockets, real Redis), which shows exactly which worker requests are sent and when.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
from gateway_support import MODEL_NAME, FakeWorker, gateway_settings, running_gateway
from yutu.engine.tokenizer import Tokenizer
from yutu.protocol.generate import RequestFailed, TokenDelta

from services.gateway.limits import RequestLimits
from services.gateway.memory import MemoryReleaser, release_memory
from services.gateway.tokenization import INLINE_CHARS, PromptTokenizer


def _words(num_chars: int) -> str:
    unit = "the jade rabbit 月亮 pounds herbs 🐇 on the moon\n"
    return (unit * (num_chars // len(unit) + 1))[:num_chars]


async def test_large_texts_queue_on_the_pool_while_small_ones_run_inline(tiny_model: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model)
    prompts = PromptTokenizer(tok, threads=1, releaser=MemoryReleaser())
    started, release = threading.Event(), threading.Event()

    def hold() -> str:
        started.set()
        release.wait(30)
        return threading.current_thread().name

    try:
        big1 = asyncio.create_task(prompts.run(INLINE_CHARS + 1, hold))
        big2 = asyncio.create_task(prompts.run(INLINE_CHARS + 1, hold))
        await asyncio.to_thread(started.wait, 30)  # the pool's one thread holds big1; big2 queues
        small = await prompts.run(INLINE_CHARS, lambda: threading.current_thread().name)
        assert small == threading.current_thread().name  # inline, on the event loop's thread
        assert not big1.done() and not big2.done()
        release.set()
        assert await asyncio.gather(big1, big2) == ["tokenize_0", "tokenize_0"]
        big = _words(INLINE_CHARS * 5)
        assert await prompts.encode([big, "Hello"], None, "prompt") == [tok.encode(big), tok.encode("Hello")]
    finally:
        release.set()
        prompts.close()
    assert release_memory() is True  # glibc: malloc_trim is there


# -- the choice cap (control logic, scripted worker) ----------------------------------------------------


async def test_choices_beyond_the_cap_start_as_earlier_ones_end_and_never_after_a_failure(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    settings = gateway_settings(
        tiny_model, redis_url, registry_prefix, limits=RequestLimits(max_choices_in_flight=2)
    )
    async with running_gateway(settings) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1, "n": 5, "seed": 10}
            task = asyncio.create_task(client.post("/v1/completions", json=body))
            running = {}
            for _ in range(2):
                ident, req = await fake_worker.next_request()
                running[req.sampling["seed"] - 10] = (ident, req)  # seed = seed + choice index
            assert sorted(running) == [0, 1] and fake_worker.requests.empty()  # choice 2 waits

            async def end(choice: int, token: int) -> None:
                ident, req = running.pop(choice)
                await fake_worker.send(ident, TokenDelta(req.request_id, [token], finish_reason="length"))

            # Ending one choice starts the next waiting one, lowest index first, never more than two.
            for ended, started in [(1, 2), (0, 3), (2, 4)]:
                await end(ended, 376)
                ident, req = await fake_worker.next_request()
                assert req.sampling["seed"] - 10 == started
                running[started] = (ident, req)
                assert fake_worker.requests.empty()
            await end(4, 16)
            await end(3, 376)
            resp = (await task).json()
            assert [(c["index"], c["text"]) for c in resp["choices"]] == [
                (0, "Hello"),
                (1, "Hello"),
                (2, "Hello"),
                (3, "Hello"),
                (4, ","),
            ]
            assert resp["usage"]["completion_tokens"] == 5

            # A failed choice fails the response; the choices still waiting are never sent.
            task = asyncio.create_task(client.post("/v1/completions", json=body))
            (i0, r0), (_, r1) = await fake_worker.next_request(), await fake_worker.next_request()
            await fake_worker.send(i0, RequestFailed(r0.request_id, "internal_error", "engine step failed"))
            resp2 = await task
            assert resp2.status_code == 500 and resp2.json()["error"]["message"] == "engine step failed"
            await fake_worker.wait_abort(r1.request_id)  # the other running choice is aborted
            assert fake_worker.requests.empty()


async def test_a_requests_priority_and_cache_salt_reach_the_worker(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    """vLLM's request-level fields travel on the generate request (not in its sampling): each choice
    carries the request's priority and cache salt; unset, the defaults (0, none)."""
    settings = gateway_settings(tiny_model, redis_url, registry_prefix)
    async with running_gateway(settings) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            for extra, want in [
                ({"priority": -3, "cache_salt": "tenant-a"}, (-3, "tenant-a")),
                ({}, (0, None)),
            ]:
                body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1, "n": 2, **extra}
                task = asyncio.create_task(client.post("/v1/completions", json=body))
                for _ in range(2):
                    ident, req = await fake_worker.next_request()
                    assert (req.priority, req.cache_salt) == want and "priority" not in req.sampling
                    await fake_worker.send(ident, TokenDelta(req.request_id, [16], finish_reason="length"))
                assert (await task).status_code == 200


async def test_a_requests_own_chat_template_only_where_the_gateway_trusts_it(
    tiny_model: Path, redis_url: str, registry_prefix: str, fake_worker: FakeWorker
) -> None:
    """vLLM's chat_template in a request: rendered (in the sandbox) instead of the model's, on chat
    completions and /tokenize, by a gateway started with --trust-request-chat-template; by another,
    a 400 naming the flag. A template that does not parse is a 400 naming messages."""
    tok = Tokenizer.from_dir(tiny_model)
    template = "{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template": template}  # fmt: skip
    want = tok.encode("[user: hi]", add_special_tokens=False)
    trusted = gateway_settings(tiny_model, redis_url, registry_prefix, trust_request_chat_template=True)
    async with running_gateway(trusted) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            task = asyncio.create_task(client.post("/v1/chat/completions", json=chat))
            ident, req = await fake_worker.next_request()
            assert req.prompt_token_ids == want
            await fake_worker.send(ident, TokenDelta(req.request_id, [16], finish_reason="length"))
            assert (await task).status_code == 200
            tokenized = await client.post(
                "/tokenize", json={"messages": chat["messages"], "chat_template": template}
            )
            assert tokenized.json()["tokens"] == want
            broken = await client.post("/v1/chat/completions", json={**chat, "chat_template": "{% for %}"})
            assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages"
    async with running_gateway(gateway_settings(tiny_model, redis_url, registry_prefix)) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            for path, body in [
                ("/v1/chat/completions", chat),
                ("/tokenize", {"messages": chat["messages"], "chat_template": template}),
            ]:
                refused = await client.post(path, json=body)
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert (
                    error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
                )
    assert fake_worker.requests.empty()
