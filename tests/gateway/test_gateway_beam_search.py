"""vLLM's use_beam_search through the gateway and a real worker, against a beam search written here
on the model's own logits (the algorithm vLLM's server runs, spelled out independently)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch
from gateway_support import MODEL_NAME, Stack
from yutu.engine.loader import load_model
from yutu.engine.testing import PagedRunner
from yutu.engine.tokenizer import Tokenizer

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model(stack: Stack) -> torch.nn.Module:
    m, _ = load_model(stack.model_dir, torch.device("cpu"), torch.float32)
    return m


def reference(
    model: torch.nn.Module,
    prompt: list[int],
    width: int,
    max_tokens: int,
    eos: set[int],
    length_penalty: float,
) -> list[tuple[list[int], bool]]:
    """The ``width`` best beams of ``prompt`` (tokens, ended by eos), best first: each round extends
    every live beam by its ``2 * width`` likeliest tokens and keeps the ``width`` best live ones by
    cumulative logprob / (prompt + generated - ending eos) ** length_penalty."""

    def next_logprobs(tokens: list[int]) -> torch.Tensor:
        (logits,) = PagedRunner(model, num_blocks=16, block_size=16).step([(0, tokens)])
        return torch.log_softmax(logits[-1], dim=-1)

    def score(beam: tuple[list[int], float, bool]) -> float:
        tokens, cum, ended = beam
        return cum / ((len(prompt) + len(tokens) - int(ended)) ** length_penalty)

    live: list[tuple[list[int], float, bool]] = [([], 0.0, False)]
    done: list[tuple[list[int], float, bool]] = []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum, _ended in live:
            values, ids = next_logprobs(prompt + tokens).topk(2 * width)
            for value, token in zip(values.tolist(), ids.tolist(), strict=True):
                grown.append((tokens + [token], cum + value, token in eos))
        done += [b for b in grown if b[2]]
        live = sorted((b for b in grown if not b[2]), key=score, reverse=True)[:width]
        if not live:
            break
    return [(tokens, ended) for tokens, _, ended in sorted(done + live, key=score, reverse=True)[:width]]


def post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=120)


@pytest.mark.parametrize(("width", "length_penalty"), [(1, 1.0), (3, 1.0), (3, 0.0)])
def test_beam_search_finds_the_reference_beams(
    stack: Stack, model: torch.nn.Module, width: int, length_penalty: float
) -> None:
    tok = Tokenizer.from_dir(stack.model_dir)
    prompt = tok.encode(PROMPT)
    want = reference(model, prompt, width, 6, set(tok.eos_token_ids), length_penalty)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "n": width, "temperature": 0,
            "use_beam_search": True, "length_penalty": length_penalty, "return_token_ids": True}  # fmt: skip
    resp = post(stack, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert [c["token_ids"] for c in got["choices"]] == [tokens for tokens, _ in want]
    assert [c["finish_reason"] for c in got["choices"]] == [
        "stop" if ended else "length" for _, ended in want
    ]
    assert [c["text"] for c in got["choices"]] == [tok.decode(tokens) for tokens, _ in want]
    assert got["usage"]["prompt_tokens"] == len(prompt)
    assert got["usage"]["completion_tokens"] == sum(len(tokens) for tokens, _ in want)
    if width == 1:  # one beam of the likeliest tokens: greedy decoding's
        greedy = post(
            stack, "/v1/completions", {**body, "use_beam_search": False, "n": 1, "ignore_eos": True}
        )
        assert got["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]


def test_beam_search_on_chat_and_on_several_prompts(stack: Stack, model: torch.nn.Module) -> None:
    tok = Tokenizer.from_dir(stack.model_dir)
    messages = [{"role": "user", "content": "Tell a story"}]
    chat = post(stack, "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages, "max_tokens": 4, "n": 2,
                                                 "use_beam_search": True, "return_token_ids": True})  # fmt: skip
    assert chat.status_code == 200, chat.text
    reply = chat.json()
    want = reference(model, reply["prompt_token_ids"], 2, 4, set(tok.eos_token_ids), 1.0)
    assert [c["token_ids"] for c in reply["choices"]] == [tokens for tokens, _ in want]
    assert [c["message"]["content"] for c in reply["choices"]] == [tok.decode(t) for t, _ in want]
    both = post(stack, "/v1/completions", {"model": MODEL_NAME, "prompt": [PROMPT, "a b c"], "max_tokens": 3, "n": 2,
                                            "use_beam_search": True, "echo": True})  # fmt: skip
    assert both.status_code == 200, both.text
    choices = both.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["text"].startswith(PROMPT) for c in choices[:2]) and all(
        c["text"].startswith("a b c") for c in choices[2:]
    )
    assert both.json()["usage"]["prompt_tokens"] == len(tok.encode(PROMPT)) + len(tok.encode("a b c"))


def sse_payloads(stack: Stack, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{stack.base_url}{path}", json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_beam_search_streamed_as_vllm_streams_it(stack: Stack) -> None:
    """Streamed, a beam search sends what its whole response holds once the search ends: each
    completion choice in one chunk (text, finish reason, ids); a chat choice's role, its content and
    its finish; the usage last where asked (and on every chunk with continuous_usage_stats)."""
    body = {"model": MODEL_NAME, "prompt": [PROMPT, "a b c"], "max_tokens": 4, "n": 2, "use_beam_search": True,
            "echo": True, "return_token_ids": True}  # fmt: skip
    whole = post(stack, "/v1/completions", body).json()
    options = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, last = sse_payloads(stack, "/v1/completions", {**body, "stream_options": options})
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert all(c["usage"] == whole["usage"] and len(c["choices"]) == 1 for c in chunks)
    streamed = sorted((c["choices"][0] for c in chunks), key=lambda choice: choice["index"])
    keys = ("index", "text", "finish_reason", "prompt_token_ids", "token_ids")
    assert [{k: c[k] for k in keys} for c in streamed] == [{k: c[k] for k in keys} for c in whole["choices"]]

    messages = [{"role": "user", "content": "Tell a story"}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 4, "n": 2, "use_beam_search": True}
    whole = post(stack, "/v1/chat/completions", body).json()
    chunks = sse_payloads(stack, "/v1/chat/completions", body)
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    for choice in whole["choices"]:
        deltas = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(d["delta"].get("content") or "" for d in deltas) == choice["message"]["content"]
        assert [d["finish_reason"] for d in deltas][-1] == choice["finish_reason"]
        assert all(d["finish_reason"] is None for d in deltas[:-1])


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"n": 11}, "n"),
        ("/v1/completions", {"temperature": 0.7}, "temperature"),
        ("/v1/completions", {"top_p": 0.5}, "top_p"),
        ("/v1/completions", {"logprobs": 2}, "logprobs"),
        ("/v1/completions", {"stop": ["\n"]}, "stop"),
        ("/v1/completions", {"guided_regex": "[a-z]+"}, "guided_regex"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "now"}}]}, "tools"),
        ("/v1/completions", {"length_penalty": "long"}, "length_penalty"),
    ],
)
def test_what_beam_search_does_not_use_is_refused(
    stack: Stack, path: str, extra: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 2, "n": 2, "use_beam_search": True}
    base |= (
        {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    resp = post(stack, path, {**base, **extra})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
