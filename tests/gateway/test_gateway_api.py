"""The OpenAI API against a real worker, through the official ``openai`` client.

Greedy output is checked token for token against the model run directly (no server), logprob
values against the model's own log-softmax, and streamed text against non-streamed text.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import httpx
import openai
import pytest
import torch
from gateway_support import MODEL_NAME, Stack
from yutu.engine.loader import load_model
from yutu.engine.testing import PagedRunner, greedy_generate
from yutu.engine.tokenizer import Tokenizer

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(stack: Stack) -> torch.nn.Module:
    m, _ = load_model(stack.model_dir, torch.device("cpu"), torch.float32)
    return m


def ids_of(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.split(":", 1)[1]) for t in tokens]


def test_models_health_ready(stack: Stack, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    card = models.data[0].model_dump()
    assert card["max_model_len"] == stack.max_model_len
    assert "yutu_note" not in card  # a real (if tiny) checkpoint, not the demo model
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert httpx.get(f"{stack.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{stack.base_url}/ready").json() == {"ready": True}


def test_greedy_completion_equals_the_model_run_directly(
    stack: Stack, client: openai.OpenAI, model: torch.nn.Module
) -> None:
    tok = Tokenizer.from_dir(stack.model_dir)
    prompt_ids = tok.encode(PROMPT)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    choice = out.choices[0]
    got = ids_of(choice.logprobs.tokens)
    assert got == greedy_generate(model, prompt_ids, 12)
    assert choice.finish_reason == "length"
    assert choice.text == tok.decode(got)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        len(prompt_ids),
        12,
        len(prompt_ids) + 12,
    )
    # Logprob values are the model's own log-softmax at each position.
    runner = PagedRunner(model, num_blocks=8, block_size=16)
    (logits,) = runner.step([(0, prompt_ids + got[:-1])])
    ref = torch.log_softmax(logits[len(prompt_ids) - 1 :], dim=-1)  # (12, V)
    for i, token_id in enumerate(got):
        assert choice.logprobs.token_logprobs[i] == pytest.approx(ref[i, token_id].item(), abs=1e-4)
        top = choice.logprobs.top_logprobs[i]
        assert len(top) == 3  # greedy: the sampled token is the best alternative
        best_key, best_lp = max(top.items(), key=lambda kv: kv[1])
        assert best_key == f"token_id:{token_id}" and best_lp == choice.logprobs.token_logprobs[i]
        want = torch.topk(ref[i], 3)
        assert ids_of(list(top)) == want.indices.tolist()
        assert list(top.values()) == pytest.approx(want.values.tolist(), abs=1e-4)
    # Offsets follow the text: each token's text starts where the previous one ended.
    plain = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert plain.choices[0].text == choice.text  # a second identical request: the same text
    offsets = plain.choices[0].logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert all(len(t) == 1 for t in plain.choices[0].logprobs.top_logprobs)  # logprobs=0: the sampled token


def test_prompt_as_token_ids_and_as_a_list(stack: Stack, client: openai.OpenAI) -> None:
    tok = Tokenizer.from_dir(stack.model_dir)
    args = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    by_text = client.completions.create(prompt=PROMPT, **args).choices[0].text
    by_ids = client.completions.create(prompt=tok.encode(PROMPT), **args).choices[0].text
    assert by_ids == by_text
    other = client.completions.create(prompt="a b c", **args).choices[0].text
    both = client.completions.create(prompt=[PROMPT, "a b c"], **args)
    assert [(c.index, c.text) for c in both.choices] == [(0, by_text), (1, other)]


def test_echo_repeats_the_prompt_with_its_logprobs(
    stack: Stack, client: openai.OpenAI, model: torch.nn.Module
) -> None:
    """``echo`` with ``logprobs`` (lm-evaluation-harness's loglikelihood requests): the prompt's text
    and tokens first, the first token's logprob null, the others the model's own log-softmax under
    the tokens before them; then the completion as without echo, its offsets after the prompt's."""
    tok = Tokenizer.from_dir(stack.model_dir)
    prompt_ids = tok.encode(PROMPT)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    args = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    plain = client.completions.create(**args, extra_body=extra).choices[0]
    echoed = client.completions.create(**args, echo=True, extra_body=extra).choices[0]
    assert echoed.text == PROMPT + plain.text
    lp = echoed.logprobs
    n = len(prompt_ids)
    assert ids_of(lp.tokens) == prompt_ids + ids_of(plain.logprobs.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[n:] == plain.logprobs.token_logprobs
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[n:] == [o + len(PROMPT) for o in plain.logprobs.text_offset]
    (logits,) = PagedRunner(model, num_blocks=8, block_size=16).step([(0, prompt_ids)])
    ref = torch.log_softmax(logits, dim=-1)  # (n, V): row j scores token j + 1
    for j in range(1, n):
        assert lp.token_logprobs[j] == pytest.approx(ref[j - 1, prompt_ids[j]].item(), abs=1e-4)
        top = lp.top_logprobs[j]
        want = torch.topk(ref[j - 1], 2).indices.tolist()
        assert set(ids_of(list(top))) == set(want) | {prompt_ids[j]}  # the top 2 and the prompt's token
    # echo alone: the text, no logprobs; token ids in, their decoded text out; two prompts, one token
    alone = client.completions.create(**{**args, "logprobs": None}, echo=True, extra_body=extra)
    assert alone.choices[0].text == PROMPT + plain.text and alone.choices[0].logprobs is None
    by_ids = client.completions.create(**{**args, "prompt": prompt_ids}, echo=True, extra_body=extra)
    assert by_ids.choices[0].text == tok.decode(prompt_ids) + plain.text
    both = client.completions.create(
        **{**args, "prompt": [PROMPT, "a b c"], "max_tokens": 1, "logprobs": 1}, echo=True, extra_body=extra
    )
    assert [c.text[: len(p)] for c, p in zip(both.choices, [PROMPT, "a b c"], strict=True)] == [
        PROMPT,
        "a b c",
    ]
    assert ids_of(both.choices[1].logprobs.tokens)[:-1] == tok.encode("a b c")
    assert both.usage.completion_tokens == 2
    # max_tokens 0 (the old harness's scoring request): the prompt scored, nothing generated
    scored = client.completions.create(**{**args, "max_tokens": 0}, echo=True, extra_body=extra)
    assert scored.choices[0].text == PROMPT and scored.choices[0].finish_reason == "length"
    assert ids_of(scored.choices[0].logprobs.tokens) == prompt_ids
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (n, 0)


def test_prompt_logprobs_in_completions_and_chat(stack: Stack, model: torch.nn.Module) -> None:
    """vLLM's ``prompt_logprobs``: per prompt token (the first null) a dict from token id to its
    logprob, rank and text -- the prompt's token first, then the k most likely -- the model's own
    log-softmax; per choice on completions, once for the response on chat. With echo and logprobs
    asking fewer alternatives, each gets its own count."""
    tok = Tokenizer.from_dir(stack.model_dir)
    prompt_ids = tok.encode(PROMPT)
    (logits,) = PagedRunner(model, num_blocks=8, block_size=16).step([(0, prompt_ids)])
    ref = torch.log_softmax(logits, dim=-1)  # (n, V): row j scores token j + 1
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2,
            "echo": True, "logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
    resp = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for j in range(1, len(prompt_ids)):
        token, row = prompt_ids[j], ref[j - 1]
        best = torch.topk(row, 2).indices.tolist()
        assert list(entries[j]) == list(dict.fromkeys(map(str, [token, *best])))  # its token first
        own = entries[j][str(token)]
        assert own["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert own["rank"] == int((row >= row[token]).sum()) and own["decoded_token"] == tok.decode([token])
        for rank, alt in enumerate(best, start=1):
            assert entries[j][str(alt)]["rank"] == rank
            assert entries[j][str(alt)]["logprob"] == pytest.approx(row[alt].item(), abs=1e-4)
        assert len(choice["logprobs"]["top_logprobs"][j]) <= 2  # echo's: logprobs 1, and the token itself
    # max_tokens 0 without echo: the prompt scored, nothing generated
    scored = httpx.post(
        f"{stack.base_url}/v1/completions",
        json={**body, "echo": False, "logprobs": None, "max_tokens": 0},
        timeout=60,
    ).json()
    assert scored["choices"][0]["text"] == "" and scored["usage"]["completion_tokens"] == 0
    assert scored["choices"][0]["prompt_logprobs"] == entries
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "n": 2,
            "prompt_logprobs": 0}  # fmt: skip
    reply = httpx.post(f"{stack.base_url}/v1/chat/completions", json=chat, timeout=60).json()
    rendered = reply["prompt_logprobs"]
    assert len(rendered) == reply["usage"]["prompt_tokens"] and rendered[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in rendered[1:])  # k = 0: its own
    assert "prompt_logprobs" not in reply["choices"][0]
    plain = httpx.post(f"{stack.base_url}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60)
    assert plain.json()["choices"][0]["prompt_logprobs"] is None


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens are what the model sees (the
    completion is that of those tokens sent alone); a prompt longer than the context is then cut,
    not refused; echo repeats what was kept; -1 keeps the context's length."""
    tok = Tokenizer.from_dir(stack.model_dir)
    long = " ".join(f"word{i}" for i in range(400))
    ids = tok.encode(long)
    assert len(ids) > stack.max_model_len
    args = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0}
    cut = client.completions.create(prompt=long, echo=True, extra_body={"truncate_prompt_tokens": 20}, **args)
    alone = client.completions.create(prompt=ids[-20:], **args)
    assert (
        cut.usage.prompt_tokens == 20 and cut.choices[0].text == tok.decode(ids[-20:]) + alone.choices[0].text
    )
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": long}], extra_body={"truncate_prompt_tokens": 30}, **args
    )
    assert chat.usage.prompt_tokens == 30
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(prompt=long, **args)  # without it: refused
    with pytest.raises(
        openai.BadRequestError, match="maximum context length"
    ):  # -1: no room left to generate
        client.completions.create(prompt=long, extra_body={"truncate_prompt_tokens": -1}, **args)
    short = client.completions.create(prompt=PROMPT, extra_body={"truncate_prompt_tokens": -1}, **args)
    assert short.usage.prompt_tokens == len(tok.encode(PROMPT))


def test_allowed_token_ids_and_bad_words(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's ``allowed_token_ids`` (every token generated is one of them, eos only if listed) and
    ``bad_words`` (greedy's own first word, banned, changes the output, which never holds the word's
    tokens). Exact orders against the engine: tests/engine; the word's encodings: test_gateway_units."""
    tok = Tokenizer.from_dir(stack.model_dir)
    args = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0}
    extra = {"return_tokens_as_token_ids": True}
    for sampled in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        got = client.completions.create(
            **{**args, **sampled}, extra_body={**extra, "allowed_token_ids": [17, 23, 40]}
        )
        assert (
            set(ids_of(got.choices[0].logprobs.tokens)) <= {17, 23, 40}
            and got.choices[0].finish_reason == "length"
        )
    plain = ids_of(client.completions.create(**args, extra_body=extra).choices[0].logprobs.tokens)
    word = tok.decode([plain[0]]).strip()
    assert word, "greedy's first token is a word"
    got = ids_of(
        client.completions.create(**args, extra_body={**extra, "bad_words": [word]})
        .choices[0]
        .logprobs.tokens
    )
    assert got != plain
    bare = tok.encode(word, add_special_tokens=False)  # banned always (and with a space, where that differs)
    assert not any(got[i : i + len(bare)] == bare for i in range(len(got))), (bare, got)


def sse_payloads(stack: Stack, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{stack.base_url}{path}", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_return_token_ids_whole_and_streamed(stack: Stack) -> None:
    """vLLM's ``return_token_ids``: each completion choice shows its prompt's ids and its output's
    (the tokens its logprobs name), streamed across its chunks (the prompt's with the first); chat
    shows the rendered prompt's once and each choice's output ids; unasked, no such keys."""
    tok = Tokenizer.from_dir(stack.model_dir)
    body = {"model": MODEL_NAME, "prompt": [PROMPT, "a b c"], "max_tokens": 6, "temperature": 0, "n": 2,
            "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}  # fmt: skip
    whole = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=60).json()["choices"]
    for choice in whole:
        assert choice["prompt_token_ids"] == tok.encode([PROMPT, "a b c"][choice["index"] // 2])
        assert choice["token_ids"] == ids_of(choice["logprobs"]["tokens"]) and len(choice["token_ids"]) == 6
    chunks = sse_payloads(stack, "/v1/completions", body)
    for choice in whole:
        mine = [
            c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]
        ]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5,
            "temperature": 0, "return_token_ids": True}  # fmt: skip
    reply = httpx.post(
        f"{stack.base_url}/v1/chat/completions", json={**chat, "logprobs": True}, timeout=60
    ).json()
    assert len(reply["prompt_token_ids"]) == reply["usage"]["prompt_tokens"]
    assert PROMPT in tok.decode(reply["prompt_token_ids"])  # the rendered chat prompt's
    (choice,) = reply["choices"]
    assert len(choice["token_ids"]) == reply["usage"]["completion_tokens"]
    assert tok.decode(choice["token_ids"]) == choice["message"]["content"]
    streamed = sse_payloads(stack, "/v1/chat/completions", chat)
    assert streamed[0]["prompt_token_ids"] == reply["prompt_token_ids"]
    streamed_ids = [t for c in streamed[1:] for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert streamed_ids == choice["token_ids"]
    plain = httpx.post(
        f"{stack.base_url}/v1/chat/completions", json={**chat, "return_token_ids": False}, timeout=60
    )
    assert "prompt_token_ids" not in plain.json() and "token_ids" not in plain.json()["choices"][0]


@pytest.mark.parametrize("max_tokens", [5, 0])
def test_echo_streamed_equals_echo_whole(stack: Stack, client: openai.OpenAI, max_tokens: int) -> None:
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    args = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
    }
    whole = client.completions.create(**args, extra_body=extra).choices[0]
    chunks = list(client.completions.create(**args, stream=True, extra_body=extra))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    logprobs = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(whole.logprobs.token_logprobs[1:])


def test_logit_bias_and_penalties_through_the_openai_client(stack: Stack, client: openai.OpenAI) -> None:
    """A bias of 100 on one token makes greedy output that token only, in completions and chat
    (OpenAI's own parameter, token ids as keys); a bias of -100 on greedy's first token moves it;
    the penalties (``repetition_penalty`` a vLLM extra) are taken and change a repetitive greedy
    output. Exact tokens against the engine are held by tests/engine and tests/disagg."""
    args = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0}
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    forced = client.completions.create(
        prompt=PROMPT, logprobs=0, logit_bias={"17": 100}, extra_body=extra, **args
    )
    assert ids_of(forced.choices[0].logprobs.tokens) == [17] * 8
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": PROMPT}],
        logit_bias={"23": 100},
        logprobs=True,
        extra_body=extra,
        **args,
    )
    assert ids_of([t.token for t in chat.choices[0].logprobs.content]) == [23] * 8
    plain = ids_of(
        client.completions.create(prompt=PROMPT, logprobs=0, extra_body=extra, **args)
        .choices[0]
        .logprobs.tokens
    )
    banned = client.completions.create(
        prompt=PROMPT, logprobs=0, logit_bias={str(plain[0]): -100}, extra_body=extra, **args
    )
    assert ids_of(banned.choices[0].logprobs.tokens)[0] != plain[0]
    penalized = client.completions.create(
        prompt=PROMPT,
        logprobs=0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
        extra_body={**extra, "repetition_penalty": 2.0},
        **{**args, "max_tokens": 24},
    )
    got = ids_of(penalized.choices[0].logprobs.tokens)
    assert len(got) == 24 and len(set(got)) > len(set(plain))
    # min_tokens (a vLLM extra): greedy's first token, made a stop token, held back for 4 tokens
    held = client.completions.create(
        prompt=PROMPT, logprobs=0, extra_body={**extra, "stop_token_ids": [plain[0]], "min_tokens": 4}, **args
    ).choices[0]
    held_ids = ids_of(held.logprobs.tokens)
    assert len(held_ids) >= 4 and plain[0] not in held_ids[:4]
    assert held.finish_reason == ("stop" if held_ids[-1] == plain[0] else "length")


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "pet": {"enum": ["rabbit", "cat"]}},
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}  # fmt: skip


def is_person(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"name", "age", "pet"} and len(value["name"]) <= 8 and type(value["age"]) is int
        and 0 <= value["age"] <= 150 and value["pet"] in ("rabbit", "cat")
    )  # fmt: skip


def test_structured_outputs_through_the_openai_client(stack: Stack, client: openai.OpenAI) -> None:
    """OpenAI's response_format (a schema; any JSON object) and vLLM's structured_outputs and
    guided_* extras: every output follows its constraint, streamed as whole, and ends with stop."""
    messages = [{"role": "user", "content": "Describe a person."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=100,
        temperature=0,
        response_format=fmt,  # type: ignore[arg-type]
    )
    text = whole.choices[0].message.content
    assert text is not None and is_person(text), text
    assert whole.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=100,
        temperature=0,
        response_format=fmt,
        stream=True,  # type: ignore[arg-type]
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    sampled = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=100,
        temperature=1.5,
        seed=5,
        n=4,
        response_format=fmt,  # type: ignore[arg-type]
    )
    assert all(c.finish_reason == "stop" and is_person(c.message.content or "") for c in sampled.choices)
    anything = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = anything.choices[0].message.content or ""
    assert text.startswith("{")
    if anything.choices[0].finish_reason == "stop":  # a random model may not close it in 60 tokens
        assert isinstance(json.loads(text), dict)
    for extra, check in [
        (
            {"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2} (am|pm)"}},
            lambda t: len(t) == 8 and t[2] == ":",
        ),
        ({"guided_choice": ["the jade rabbit", "the moon"]}, lambda t: t in ("the jade rabbit", "the moon")),
        ({"guided_json": json.dumps(PERSON)}, is_person),
        (
            {"structured_outputs": {"grammar": 'start: "yes" | "no" ("!")*'}},
            lambda t: t == "yes" or t.startswith("no"),
        ),
    ]:
        out = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=60, temperature=1.0, seed=2, n=3, extra_body=extra
        )
        for c in out.choices:
            assert c.finish_reason == "stop" and check(c.text), (extra, c.text)


def test_json_whitespace_options(stack: Stack, client: openai.OpenAI) -> None:
    """JSON output is compact as vLLM's (", " and ": ", no other whitespace); vLLM's whitespace
    options change that: a pattern (whitespace_pattern, or guided_whitespace_pattern) allows only its
    whitespace, disable_any_whitespace false JSON's own; sampled outputs show it and still parse."""
    args = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 100, "temperature": 1.5, "seed": 3, "n": 6}
    compact = client.completions.create(**args, extra_body={"guided_json": PERSON})
    for c in compact.choices:
        assert c.finish_reason == "stop" and json.dumps(json.loads(c.text), ensure_ascii=False) == c.text, (
            c.text
        )
    for extra in (
        {"structured_outputs": {"json": PERSON, "whitespace_pattern": "\n?"}},
        {"guided_json": PERSON, "guided_whitespace_pattern": "\n?"},
    ):
        out = client.completions.create(**args, extra_body=extra)
        for c in out.choices:
            assert c.finish_reason == "stop" and is_person(c.text), (extra, c.text)
            assert ", " not in c.text.replace('", "', "")  # no space after a separator: only newlines there
        assert any("\n" in c.text for c in out.choices)  # the temperature finds the newlines
    free = client.completions.create(
        **args, extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": False}}
    )
    for c in free.choices:  # a random model spends its tokens on whitespace: some do not close
        assert c.finish_reason == "length" or is_person(c.text), c.text
    assert any(
        re.search(r"[\t\r\n]|[{\[,:] {2}| [,:}\]]", c.text) for c in free.choices
    )  # whitespace past compact
    for extra in (
        {"structured_outputs": {"regex": "[a-z]+", "whitespace_pattern": " "}},
        {"guided_whitespace_pattern": " "},
        {"structured_outputs": {"json": PERSON, "whitespace_pattern": "[("}},
    ):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**args, extra_body=extra)


def test_skip_special_tokens_false_keeps_them_in_the_text_but_not_the_one_that_ends_it(
    stack: Stack, client: openai.OpenAI
) -> None:
    """vLLM's ``skip_special_tokens``: a grammar makes the model write the special token
    <|start_header_id|> (id 2) between plain text; by default it is not in the text, with false it
    is, streamed or not, on both endpoints. A special token that ends the output (a stop token id
    here) is not text either way."""
    tok = Tokenizer.from_dir(stack.model_dir)
    assert tok.id_to_token(2) == "<|start_header_id|>" and 2 in tok.special_token_ids
    forced = {"structured_outputs": {"grammar": 'start: "ab" <[2]> "cd"'}}
    for skip, want in [(True, "abcd"), (False, "ab<|start_header_id|>cd")]:
        body = {**forced, "skip_special_tokens": skip}
        whole = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0, extra_body=body
        )
        assert whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"
        chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                                           extra_body=body, stream=True)  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=20, temperature=0, extra_body=body)  # fmt: skip
        assert chat.choices[0].message.content == want
    ended = {"structured_outputs": {"grammar": 'start: "ab" <[3]> "zz"'}, "stop_token_ids": [3]}
    for skip in (True, False):
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                                        extra_body={**ended, "skip_special_tokens": skip})  # fmt: skip
        assert out.choices[0].text == "ab" and out.choices[0].finish_reason == "stop"


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                          "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
       "additionalProperties": False}}}  # fmt: skip


def test_a_named_tool_call_streamed_and_whole(stack: Stack, client: openai.OpenAI) -> None:
    """tool_choice naming a function: one call of it, arguments that follow its schema, content
    null, finish_reason stop (OpenAI's); streamed, the id and name first, then the arguments."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    args: dict[str, Any] = dict(model=MODEL_NAME, messages=messages, tools=[WEATHER, NOW], max_tokens=80, temperature=0,
                                tool_choice={"type": "function", "function": {"name": "weather"}})  # fmt: skip
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    value = json.loads(call.function.arguments)
    assert set(value) == {"city", "unit"} and len(value["city"]) <= 10 and value["unit"] in ("c", "f")
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "weather"
    assert all(d.id is None and d.index == 0 for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_required_tool_calls_streamed_and_whole(stack: Stack, client: openai.OpenAI) -> None:
    """tool_choice required: one or more calls of the tools, finish_reason tool_calls. A bias on
    "]" and "}" makes the tiny random model close its array as soon as the schema lets it."""
    tok = Tokenizer.from_dir(stack.model_dir)
    bias = {str(tok.token_to_id(c)): 100 for c in ("]", "}")}
    messages = [{"role": "user", "content": "What time is it, and the weather in Oslo?"}]
    args: dict[str, Any] = dict(model=MODEL_NAME, messages=messages, tools=[WEATHER, NOW], max_tokens=120,
                                temperature=0, tool_choice="required", logit_bias=bias)  # fmt: skip
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls and all(c.function.name in ("weather", "now") for c in calls)
    for c in calls:
        assert isinstance(json.loads(c.function.arguments), dict)
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas if d.function] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # cut short by max_tokens: no call, the text as it is, finish_reason length
    short = client.chat.completions.create(**{**args, "max_tokens": 3, "logit_bias": None})
    assert short.choices[0].finish_reason == "length" and short.choices[0].message.tool_calls is None
    assert (short.choices[0].message.content or "").startswith("[")


def test_auto_tool_calls_found_in_the_text(stack: Stack, client: openai.OpenAI) -> None:
    """tool_choice auto (the default with tools; this gateway parses the hermes format): the text
    before a call is content, the call a tool call, finish_reason tool_calls, streamed as whole.
    A regex makes the random model write the format; text that only looks like its start is content."""
    messages = [{"role": "user", "content": "What time is it?"}]
    call = r'Sure\. <tool_call>\{"name": "now", "arguments": \{\}\}</tool_call>'
    args: dict[str, Any] = dict(model=MODEL_NAME, messages=messages, tools=[WEATHER, NOW], max_tokens=60, temperature=0,
                                extra_body={"guided_regex": call})  # fmt: skip
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    (got,) = choice.message.tool_calls or []
    assert (got.function.name, got.function.arguments) == ("now", "{}")
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure. "
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas if d.function] == [("now", "{}")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    for text in ["<tool_cal>not a call", "<tool_call>{nope}</tool_call>"]:
        args["extra_body"] = {"guided_regex": "".join("\\" + c if c in "{}" else c for c in text)}
        plain = client.chat.completions.create(**args)
        assert plain.choices[0].message.content == text and plain.choices[0].message.tool_calls is None
        assert plain.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(**args, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_a_tool_result_turn_and_tool_choice_none(stack: Stack, client: openai.OpenAI) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]  # fmt: skip
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=5,
        temperature=0,  # type: ignore[arg-type]
    )
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    assert out.choices[0].finish_reason == "length"


def test_chat_stream_concatenates_to_the_non_streamed_text(stack: Stack, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    args = {"model": MODEL_NAME, "messages": messages, "max_tokens": 20, "temperature": 0}
    full = client.chat.completions.create(**args)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content
    assert text and full.usage.completion_tokens > 0
    tok = Tokenizer.from_dir(stack.model_dir)
    assert full.usage.prompt_tokens == len(tok.encode_chat(messages))

    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    # The same prompt again: its full blocks come from the worker's prefix cache.
    assert (
        usage.prompt_tokens_details.cached_tokens
        == (usage.prompt_tokens // stack.block_size) * stack.block_size
    )
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"

    # Raw SSE: data lines, then [DONE].
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json={**args, "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert "usage" not in lines[-2] or json.loads(lines[-2][6:])["usage"] is None  # no include_usage


def test_chat_logprobs_shape(stack: Stack, client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        if not entry.token.startswith("bytes:"):
            assert bytes(entry.bytes) == entry.token.encode("utf-8")
    no_lp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert no_lp.choices[0].logprobs is None
    assert (no_lp.usage.completion_tokens, no_lp.choices[0].finish_reason) == (3, "length")


def test_n_and_seed_reproducibility(stack: Stack, client: openai.OpenAI) -> None:
    args = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    two = client.completions.create(n=2, seed=1234, **args)
    assert [c.index for c in two.choices] == [0, 1]
    again = client.completions.create(n=2, seed=1234, **args)
    assert [c.text for c in again.choices] == [c.text for c in two.choices]
    assert two.choices[0].text != two.choices[1].text  # seeds 1234 and 1235
    # Choice i runs with seed + i: choice 1 of n=2 is the single choice of seed 1235.
    single = client.completions.create(n=1, seed=1235, **args)
    assert single.choices[0].text == two.choices[1].text
    assert two.usage.completion_tokens == 20 and two.usage.prompt_tokens == single.usage.prompt_tokens
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, seed=7
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_min_p_reaches_the_sampler(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's min_p: 1 keeps only the most likely token, so sampling hot with it is greedy; it was
    once ignored silently. Out of [0, 1] it is a 400 naming it."""
    args: dict[str, Any] = dict(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True}
    )
    greedy = client.completions.create(temperature=0, **args).choices[0].text
    hot = client.completions.create(
        temperature=1.8, seed=5, n=2, **{**args, "extra_body": {"ignore_eos": True, "min_p": 1.0}}
    )
    assert [c.text for c in hot.choices] == [greedy, greedy]
    loose = client.completions.create(
        temperature=1.8, seed=5, n=2, **{**args, "extra_body": {"ignore_eos": True, "min_p": 0.0}}
    )
    assert any(c.text != greedy for c in loose.choices)  # the same draws without it wander off
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**{**args, "extra_body": {"min_p": 1.5}})
    assert refused.value.body["param"] == "min_p"  # type: ignore[index]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(
    stack: Stack, client: openai.OpenAI
) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far (the
    prompt's tokens, the completion's growing by the tokens sent), ending at the final usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    completion = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                                stream=True, stream_options=options, extra_body={"ignore_eos": True}))  # type: ignore[arg-type]  # fmt: skip
    chat = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=8, temperature=0, stream=True, stream_options=options,  # type: ignore[arg-type]
                                               extra_body={"ignore_eos": True}))  # fmt: skip
    for chunks in (completion, chat):
        final = chunks[-1].usage
        assert final is not None and final.completion_tokens == 8 and not chunks[-1].choices
        counts = [c.usage.completion_tokens for c in chunks[:-1] if c.usage is not None]
        assert len(counts) == len(chunks) - 1  # every chunk, not only the last
        assert counts == sorted(counts) and counts[-1] == 8
        assert {c.usage.prompt_tokens for c in chunks if c.usage is not None} == {final.prompt_tokens}
    plain = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}))  # fmt: skip
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None


def test_stop_strings_truncate_and_finish_with_stop(stack: Stack, client: openai.OpenAI) -> None:
    args = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(max_tokens=30, **args).choices[0].text
    # A stop string from the middle of the greedy text (its first occurrence, clean characters).
    start = next(
        i for i in range(3, len(full) - 3) if "\ufffd" not in full[i : i + 2] and full[i : i + 2].strip()
    )
    stop = full[start : start + 2]
    cut = full.index(stop)
    out = client.completions.create(max_tokens=30, stop=[stop, "never-seen-xyz"], **args)
    assert out.choices[0].text == full[:cut]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_dump()["stop_reason"] == stop
    assert out.usage.completion_tokens < 30
    streamed = list(client.completions.create(max_tokens=30, stop=stop, stream=True, **args))
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"
    # vLLM's include_stop_str_in_output: the text ends with the stop string
    kept = {**args, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}
    out = client.completions.create(max_tokens=30, stop=[stop], **kept)
    assert out.choices[0].text == full[: cut + len(stop)] and out.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(max_tokens=30, stop=stop, stream=True, **kept))
    assert "".join(c.choices[0].text for c in streamed) == full[: cut + len(stop)]


def test_cached_tokens_count_the_reused_full_blocks(stack: Stack, client: openai.OpenAI) -> None:
    rng = random.Random(99)
    prompt = [rng.randrange(10, 500) for _ in range(100)]  # 6 full blocks of 16, then 4 tokens
    args = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = client.completions.create(**args)
    assert first.usage.prompt_tokens == 100
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(**args)
    assert second.usage.prompt_tokens_details.cached_tokens == (100 // stack.block_size) * stack.block_size
    assert second.choices[0].text == first.choices[0].text


def test_a_cache_salt_keeps_tenants_apart_in_the_prefix_cache(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's ``cache_salt``: a prompt cached under one salt is found again by that salt only (chat
    and completions alike); the output does not depend on it."""
    rng = random.Random(98)
    prompt = [rng.randrange(10, 500) for _ in range(70)]
    args = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def cached(salt: str | None) -> tuple[int, str]:
        out = client.completions.create(**args, extra_body={} if salt is None else {"cache_salt": salt})
        assert out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens, out.choices[0].text

    first, text = cached("tenant-a")
    assert first == 0
    assert cached("tenant-b") == (0, text) and cached(None) == (0, text)
    assert cached("tenant-a") == (64, text)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w " * 40}], "max_tokens": 2}
    warm = client.chat.completions.create(**chat, extra_body={"cache_salt": "tenant-c"})
    again = client.chat.completions.create(**chat, extra_body={"cache_salt": "tenant-c"})
    other = client.chat.completions.create(**chat, extra_body={"cache_salt": "tenant-d"})
    assert warm.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(**args, extra_body={"cache_salt": ""})


def test_chat_echo_repeats_the_message_the_response_continues(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's chat ``echo``: with the last message continued (``continue_final_message``), the
    response's content is that message's then the model's -- whole and streamed alike; a new
    assistant message after a user's repeats nothing."""
    opening = "Once upon a time, the rabbit"
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": opening}]
    args = {"model": MODEL_NAME, "messages": messages, "max_tokens": 6, "temperature": 0}
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**args, extra_body=cont).choices[0].message.content
    echoed = (
        client.chat.completions.create(**args, extra_body={**cont, "echo": True}).choices[0].message.content
    )
    assert plain and echoed == opening + plain
    chunks = list(client.chat.completions.create(**args, stream=True, extra_body={**cont, "echo": True}))
    assert chunks[1].choices[0].delta.content == opening  # right after the role
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    fresh = {**args, "messages": messages[:1]}
    without = client.chat.completions.create(**fresh).choices[0].message.content
    assert (
        client.chat.completions.create(**fresh, extra_body={"echo": True}).choices[0].message.content
        == without
    )
