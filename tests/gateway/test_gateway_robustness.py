"""The gateway refuses cheaply and fairly: invalid text, huge prompts, costly requests, greedy n.

Against the real worker of ``stack`` (context 256) and a gateway of this module's own (a subprocess,
so its RSS can be read) with small limits: --max-n 64, --max-total-tokens 4096 and
--max-choices-in-flight 4. The control logic under them (the tokenizer pool, the choice cap) is
tested in test_gateway_admission.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_support import MODEL_NAME, Stack, gateway_url, start_gateway, stop_process, wait_ready

from services.gateway.memory import rss_bytes

MAX_N, MAX_TOTAL, IN_FLIGHT = 64, 4096, 4
TEN_MB = 10 * 2**20


class Guarded:
    def __init__(self, url: str, proc: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.proc = proc

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", timeout=60, **kwargs)

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = httpx.get(f"{self.url}/info", timeout=10).json()
        return info


@pytest.fixture(scope="module")
def guarded(stack: Stack) -> Iterator[Guarded]:
    proc = start_gateway(
        stack.logs, stack.model_dir, stack.redis_url, stack.prefix,
        "--max-n", str(MAX_N), "--max-total-tokens", str(MAX_TOTAL),
        "--max-choices-in-flight", str(IN_FLIGHT), "--tokenizer-threads", "1",
    )  # fmt: skip
    try:
        url = gateway_url(stack.redis_url, stack.prefix, proc)
        wait_ready(url, [proc])
        yield Guarded(url, proc)
    finally:
        stop_process(proc)


def envelope(resp: httpx.Response, status: int, type_: str, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err: dict[str, Any] = body["error"]
    assert (err["type"], err["param"]) == (type_, param), err
    return err


# -- invalid text ---------------------------------------------------------------------------------

CMPL = '{"model": "tiny", "max_tokens": 2, '
CHAT = '{"model": "tiny", "max_tokens": 2, "messages": '


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", CMPL + '"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", CMPL + '"prompt": ["ok", "\\udfff"]}', "prompt.1"),
        ("/v1/completions", CMPL + '"prompt": "hi", "stop": ["x", "\\ud83d"]}', "stop.1"),
        ("/v1/completions", CMPL + '"prompt": "hi", "user": "\\ud800"}', "user"),
        ("/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', "model"),
        ("/v1/chat/completions", CHAT + '[{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
        (
            "/v1/chat/completions",
            CHAT + '[{"role": "user", "content": [{"type": "text", "text": "ok\\udc00"}]}]}',
            "messages.0.content.0.text",
        ),
        ("/v1/chat/completions", CHAT + '[{"role": "user", "content": "hi", "name": "\\ud800"}]}', "messages.0.name"),
        ("/v1/chat/completions", CHAT + '[{"role": "user", "content": "hi", "extra": {"k": "\\ud800"}}]}',
         "messages.0.extra.k"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(
    stack: Stack, path: str, raw: str, param: str
) -> None:
    resp = httpx.post(
        f"{stack.base_url}{path}", content=raw.encode(), headers={"content-type": "application/json"}
    )
    err = envelope(resp, 400, "invalid_request_error", param)
    assert "lone UTF-16 surrogate" in err["message"], err


def test_surrogate_bytes_in_raw_utf8_are_refused_too(stack: Stack) -> None:
    # Python's json reads bytes with "surrogatepass": ED A0 80 becomes U+D800.
    raw = b'{"model": "tiny", "max_tokens": 2, "prompt": "a\xed\xa0\x80"}'
    resp = httpx.post(
        f"{stack.base_url}/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    err = envelope(resp, 400, "invalid_request_error", "prompt")
    assert "U+D800" in err["message"]
    # A valid pair is one character, and is generated from as usual.
    ok = stack_post(stack, "/v1/completions", {"model": MODEL_NAME, "prompt": "\U0001f407", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def stack_post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=60)


# -- huge prompts -----------------------------------------------------------------------------------


def _words(num_chars: int) -> str:
    unit = "the jade rabbit 月亮 pounds herbs 🐇 on the moon\n"
    return (unit * (num_chars // len(unit) + 1))[:num_chars]


async def _huge_prompt_and_a_small_request(url: str, path: str, big: dict[str, Any]) -> None:
    small = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    payload = json.dumps(big).encode()
    assert len(payload) > TEN_MB
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def timed_big() -> tuple[httpx.Response, float]:
            start = time.monotonic()
            resp = await client.post(path, content=payload, headers={"content-type": "application/json"})
            return resp, time.monotonic() - start

        (big_resp, big_s), small_resp = await asyncio.gather(
            timed_big(), client.post("/v1/completions", json=small)
        )
    param = "messages" if path == "/v1/chat/completions" else "prompt"
    err = envelope(big_resp, 400, "invalid_request_error", param)
    assert err["code"] == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in err["message"], err
    assert big_s < 1.0, f"a 10 MB prompt took {big_s:.2f}s to refuse (tokenizing it took ~10 s)"
    assert small_resp.status_code == 200, small_resp.text
    assert small_resp.json()["usage"]["completion_tokens"] == 4


def test_a_10mb_prompt_is_refused_before_tokenizing_while_a_small_request_is_served(stack: Stack) -> None:
    big = {"model": MODEL_NAME, "prompt": _words(TEN_MB), "max_tokens": 1}
    asyncio.run(_huge_prompt_and_a_small_request(stack.base_url, "/v1/completions", big))
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": _words(TEN_MB)}], "max_tokens": 1}
    asyncio.run(_huge_prompt_and_a_small_request(stack.base_url, "/v1/chat/completions", chat))


def test_the_length_bound_refuses_only_what_cannot_fit(stack: Stack, guarded: Guarded) -> None:
    span = guarded.info()["tokenizer"]["token_span"]
    assert span == {"chars": 19, "bytes": 19}  # the tiny model's longest token: "<|start_header_id|>"
    longest = "<|start_header_id|>"
    # 250 of the longest token: 4750 characters, 251 tokens with BOS -- it fits, so it is served.
    fits = stack_post(
        stack, "/v1/completions", {"model": MODEL_NAME, "prompt": longest * 250, "max_tokens": 1}
    )
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["prompt_tokens"] == 251
    # 257 of them (4883 > 256 * 19 characters) cannot fit whatever they encode to: refused untokenized.
    err = envelope(
        stack_post(stack, "/v1/completions", {"model": MODEL_NAME, "prompt": longest * 257, "max_tokens": 1}),
        400, "invalid_request_error", "prompt",
    )  # fmt: skip
    assert "at least 257 tokens (4883 characters" in err["message"], err
    # By UTF-8 bytes: 2000 Chinese characters pass the character bound but are 6000 bytes > 256 * 19.
    err = envelope(
        stack_post(stack, "/tokenize", {"model": MODEL_NAME, "prompt": "月" * 2000}),
        400, "invalid_request_error", "prompt",
    )  # fmt: skip
    assert "(6000 bytes of UTF-8" in err["message"], err
    # Under both bounds, /tokenize counts as before, also past the context.
    counted = stack_post(stack, "/tokenize", {"model": MODEL_NAME, "prompt": "月" * 1000})
    assert counted.status_code == 200 and counted.json()["count"] > 256, counted.text


# -- cost limits ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", {"prompt": "hi", "n": MAX_N + 1, "max_tokens": 1}, "n", "at most 64 choices"),
        ("/v1/completions", {"prompt": "hi", "n": MAX_N, "max_tokens": 65}, "max_tokens", "4160 tokens"),
        ("/v1/completions", {"prompt": ["a"] * 5, "n": 20, "max_tokens": 41}, "max_tokens", "5 prompts x n=20"),
        ("/v1/completions", {"prompt": ["a"] * 5000, "max_tokens": 1}, "max_tokens", "5000 tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                  "max_completion_tokens": 2049}, "max_completion_tokens", "4098 tokens"),
    ],
)  # fmt: skip
def test_cost_limits_are_400s_naming_the_param(
    guarded: Guarded, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    err = envelope(
        guarded.post(path, json={"model": MODEL_NAME, **body}), 400, "invalid_request_error", param
    )
    assert words in err["message"], err
    assert "--max-" in err["message"], err


def test_a_chat_without_max_tokens_counts_every_choice_to_the_end_of_the_context(guarded: Guarded) -> None:
    messages = [{"role": "user", "content": "hi"}]
    prompt_tokens = guarded.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()[
        "count"
    ]
    room = 256 - prompt_tokens
    body = {"model": MODEL_NAME, "messages": messages, "n": MAX_TOTAL // room + 1}
    err = envelope(
        guarded.post("/v1/chat/completions", json=body), 400, "invalid_request_error", "max_tokens"
    )
    assert f"may generate {body['n'] * room} tokens (n={body['n']} choices" in err["message"], err
    ok = guarded.post("/v1/chat/completions", json={**body, "n": MAX_TOTAL // room, "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_default_limits_allow_openai_n_and_no_more(stack: Stack) -> None:
    err = envelope(
        stack_post(stack, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "n": 129, "max_tokens": 1}),
        400, "invalid_request_error", "n",
    )  # fmt: skip
    assert "at most 128 choices" in err["message"]
    ok = stack_post(
        stack, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "n": 128, "max_tokens": 1}
    )
    assert ok.status_code == 200, ok.text
    assert sorted(c["index"] for c in ok.json()["choices"]) == list(range(128))


# -- one request's choices do not take every slot -----------------------------------------------------


async def _big_n_then_small(url: str, n: int, max_tokens: int) -> tuple[int, dict[str, Any], dict[int, Any]]:
    """Stream a big-n request; once it streams, send a small one. Returns (big choices finished when
    the small one was answered, the small response, the big one's final chunk per choice)."""
    big = {"model": MODEL_NAME, "prompt": "The moon", "n": n, "max_tokens": max_tokens, "ignore_eos": True,
           "stream": True, "stream_options": {"include_usage": True}, "seed": 1}  # fmt: skip
    small = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    finished: dict[int, Any] = {}
    texts: dict[int, str] = {}
    usage: dict[str, Any] = {}
    small_task: asyncio.Task[httpx.Response] | None = None
    finished_when_small_done: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json=big) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                # lines already buffered come without a suspension: give the small request's answer
                # its turn, so that it is counted when it came, not after the buffer ran dry
                await asyncio.sleep(0)
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk["choices"] == []:
                    usage = chunk["usage"]
                for choice in chunk["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                    if choice["finish_reason"] is not None:
                        assert choice["index"] not in finished
                        finished[choice["index"]] = choice
                if small_task is None:
                    small_task = asyncio.create_task(client.post("/v1/completions", json=small))
                    small_task.add_done_callback(lambda _t: finished_when_small_done.append(len(finished)))
        assert small_task is not None
        small_resp = await small_task
    assert small_resp.status_code == 200, small_resp.text
    assert usage["completion_tokens"] == n * max_tokens
    return finished_when_small_done[0], small_resp.json(), finished


def test_a_big_n_request_leaves_room_for_another_users_request(guarded: Guarded) -> None:
    n, max_tokens = MAX_N, 48  # 64 x 48 = 3072 tokens; the worker runs up to 64 sequences, 64 KV blocks
    done_before_small, small, finished = asyncio.run(_big_n_then_small(guarded.url, n, max_tokens))
    # The small request reached the worker at once, beside the first 4 choices, not behind all 64:
    # it was answered before even one wave of 4 choices (48 tokens each) could finish.
    assert done_before_small < IN_FLIGHT, f"{done_before_small} of {n} big choices finished first"
    assert small["choices"][0]["finish_reason"] == "length"
    # Every choice ran, once, to its end, under its own index.
    assert sorted(finished) == list(range(n))
    assert {c["finish_reason"] for c in finished.values()} == {"length"}


def test_choices_in_waves_equal_choices_at_once(stack: Stack, guarded: Guarded) -> None:
    """Seeded choices are the same whether 4 run at a time (guarded) or all at once (stack's default 16)."""
    body = {"model": MODEL_NAME, "prompt": "The jade rabbit", "n": 12, "max_tokens": 6, "seed": 5,
            "temperature": 0.9, "stop": [" the"]}  # fmt: skip
    waves = guarded.post("/v1/completions", json=body).json()
    at_once = stack_post(stack, "/v1/completions", body).json()
    assert [c["index"] for c in waves["choices"]] == list(range(12))
    strip = [(c["index"], c["text"], c["finish_reason"], c["stop_reason"]) for c in waves["choices"]]
    assert strip == [
        (c["index"], c["text"], c["finish_reason"], c["stop_reason"]) for c in at_once["choices"]
    ]
    assert waves["usage"] == at_once["usage"]


# -- memory --------------------------------------------------------------------------------------------


def test_rss_returns_after_big_refused_requests(guarded: Guarded) -> None:
    pid = guarded.proc.pid
    warm = {"model": MODEL_NAME, "prompt": _words(2 * 2**20), "max_tokens": 1}
    trims = guarded.info()["memory"]["trims"]
    assert guarded.post("/v1/completions", json=warm).status_code == 400  # allocator and imports warm
    _wait_for(lambda: guarded.info()["memory"]["trims"] > trims, "a trim after the warm-up request")
    before = rss_bytes(pid)
    payload = json.dumps({"model": MODEL_NAME, "prompt": _words(TEN_MB), "max_tokens": 1})

    async def four() -> list[int]:
        async with httpx.AsyncClient(base_url=guarded.url, timeout=60) as client:
            resps = await asyncio.gather(
                *[client.post("/v1/completions", content=payload, headers={"content-type": "application/json"})
                  for _ in range(4)]
            )  # fmt: skip
        return [r.status_code for r in resps]

    assert asyncio.run(four()) == [400] * 4
    bound = before + 64 * 2**20
    _wait_for(lambda: rss_bytes(pid) <= bound, f"RSS back under {bound >> 20} MiB (from {before >> 20} MiB)")


def _wait_for(condition: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
