"""vLLM's use_beam_search through the gateway and a real worker, against a beam search written here
on the model's own logits (the algorithm vLLM's server runs, spelled out independently)."""

from __future__ import annotations

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


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"stream": True}, "stream"),
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
