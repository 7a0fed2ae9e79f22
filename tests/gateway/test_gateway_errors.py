"""Bad input gets the OpenAI error envelope with the exact status and type; API keys; /tokenize."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gateway_support import MODEL_NAME, Stack, gateway_url, start_gateway, stop_process, wait_ready
from yutu.engine.tokenizer import Tokenizer

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}


def post(stack: Stack, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", timeout=30, **kwargs)


def envelope(resp: httpx.Response, status: int, type_: str, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err: dict[str, Any] = body["error"]
    assert err["type"] == type_, err
    if param is not None:
        assert err["param"] == param, err
    assert err["message"]
    return err


NOW = {"type": "function", "function": {"name": "now"}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**CMPL, "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {**CMPL, "max_tokens": 0}, "max_tokens"),  # 0 only to score the prompt
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -5}, "max_completion_tokens"),
        ("/v1/completions", {**CMPL, "temperature": "hot"}, "temperature"),
        ("/v1/completions", {**CMPL, "temperature": 2.5}, "temperature"),
        ("/v1/completions", {**CMPL, "top_p": 0}, "top_p"),
        ("/v1/completions", {**CMPL, "n": 0}, "n"),
        ("/v1/completions", {**CMPL, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {**CMPL, "prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"model": MODEL_NAME}, "prompt"),
        ("/v1/completions", {"prompt": "hi"}, "model"),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
            "messages.0.role",
        ),
        ("/v1/chat/completions", {**CHAT, "stream": "yes please"}, "stream"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools.0.function"),
        ("/v1/chat/completions", {**CHAT, "functions": [{"name": "now"}]}, "functions"),
        ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ("/v1/chat/completions", {**CHAT, "web_search_options": {}}, "web_search_options"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),  # no tools
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "later"}}},
            "tool_choice",
        ),
        ("/v1/chat/completions", {**CHAT, "tools": [NOW, NOW], "tool_choice": "required"}, "tools"),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools.0.function.name",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [NOW], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ("/v1/completions", {**CMPL, "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {**CHAT, "frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {**CMPL, "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {**CMPL, "min_tokens": 3}, "min_tokens"),  # more than max_tokens (2)
        ("/v1/chat/completions", {**CHAT, "min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {**CMPL, "repetition_penalty": 1e39}, "repetition_penalty"),  # past float32
        ("/v1/completions", {**CMPL, "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {**CMPL, "logit_bias": {"-1": 1}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"100000": 1}}, "logit_bias"),  # past the vocabulary
        ("/v1/completions", {**CMPL, "logit_bias": {"5": 150}}, "logit_bias"),
        ("/v1/completions", {**CMPL, "logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
        ("/v1/completions", {**CMPL, "logit_bias": {"5": "high"}}, "logit_bias"),
        ("/v1/completions", {**CMPL, "suffix": "end"}, "suffix"),
        ("/v1/completions", {**CMPL, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ("/v1/completions", {**CMPL, "stop": ["ok", ""]}, "stop"),
        ("/v1/completions", {**CMPL, "prompt": [1, 2, 100000]}, "prompt"),
        ("/v1/completions", {**CMPL, "prompt": []}, "prompt"),
        # structured outputs: malformed, not compiling, or two at once
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 3}},
                },
            },
            "response_format",
        ),
        ("/v1/completions", {**CMPL, "guided_regex": "(("}, "guided_regex"),
        ("/v1/completions", {**CMPL, "guided_json": "{not json"}, "guided_json"),
        ("/v1/completions", {**CMPL, "guided_choice": []}, "guided_choice"),
        ("/v1/completions", {**CMPL, "guided_grammar": "start: missing"}, "guided_grammar"),
        (
            "/v1/completions",
            {**CMPL, "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
        ),
        ("/v1/completions", {**CMPL, "structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
        # vLLM's extras no worker implements: refused, not ignored
        ("/v1/completions", {**CMPL, "use_beam_search": "yes"}, "use_beam_search"),
        ("/v1/completions", {**CMPL, "length_penalty": 0.5}, "length_penalty"),  # without beam search
        ("/v1/completions", {**CMPL, "logits_processors": ["my.Processor"]}, "logits_processors"),
        # vLLM's extras, served, at values they refuse
        ("/v1/completions", {**CMPL, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/completions", {**CMPL, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ("/v1/completions", {**CMPL, "bad_words": ["moon", ""]}, "bad_words.1"),
        ("/v1/completions", {**CMPL, "bad_words": "moon"}, "bad_words"),
        ("/v1/completions", {**CMPL, "allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {**CMPL, "allowed_token_ids": [1, 10**9]}, "allowed_token_ids"),
        ("/v1/chat/completions", {**CHAT, "allowed_token_ids": [-1]}, "allowed_token_ids"),
        ("/v1/completions", {**CMPL, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {**CMPL, "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {**CMPL, "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        ("/v1/chat/completions", {**CHAT, "priority": "high"}, "priority"),
        ("/v1/chat/completions", {**CHAT, "priority": 2**63}, "priority"),
        ("/v1/chat/completions", {**CHAT, "cache_salt": ""}, "cache_salt"),
        ("/v1/chat/completions", {**CHAT, "cache_salt": 5}, "cache_salt"),
        ("/v1/chat/completions", {**CHAT, "echo": "yes"}, "echo"),
        ("/v1/chat/completions", {**CHAT, "mm_processor_kwargs": {"fps": 2}}, "mm_processor_kwargs"),
        ("/v1/chat/completions", {**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
        ("/v1/completions", {**CMPL, "structured_outputs": {"regex": 5}}, "structured_outputs"),
        ("/v1/completions", {**CMPL, "structured_outputs": {"choice": "a"}}, "structured_outputs"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
        ),
    ],
)
def test_invalid_requests_are_400_invalid_request_error(
    stack: Stack, path: str, body: dict[str, Any], param: str
) -> None:
    envelope(post(stack, path, json=body), 400, "invalid_request_error", param)


def test_a_grammar_only_the_model_refuses_is_a_400_and_the_stack_serves_on(stack: Stack) -> None:
    """``<[N]>`` names a token id: valid Lark, so the gateway passes it, but the model has no token
    99999. Its worker finds that when it compiles the grammar, off the engine's step, after it took
    the request: still a 400 invalid_request_error, with the compiler's words."""
    body = {**CMPL, "structured_outputs": {"grammar": "start: <[99999]>"}}
    err = envelope(post(stack, "/v1/completions", json=body), 400, "invalid_request_error")
    assert "does not compile" in err["message"] and "99999" in err["message"]
    assert post(stack, "/v1/completions", json=CMPL).status_code == 200


def test_vllm_extras_at_their_neutral_values_are_served(stack: Stack) -> None:
    """Clients built for vLLM send its extras at their defaults: those ask for nothing and are fine."""
    neutral = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "bad_words": [],
               "truncate_prompt_tokens": None, "logits_processors": None, "return_token_ids": False}  # fmt: skip
    assert post(stack, "/v1/completions", json={**CMPL, **neutral, "echo": True}).status_code == 200
    chat = {**CHAT, **neutral, "echo": False, "add_special_tokens": False, "mm_processor_kwargs": {}}
    assert post(stack, "/v1/chat/completions", json=chat).status_code == 200


def test_invalid_json_and_unknown_routes(stack: Stack) -> None:
    err = envelope(
        post(
            stack,
            "/v1/completions",
            content=b'{"model": "tiny", "prompt": ',
            headers={"content-type": "application/json"},
        ),
        400,
        "invalid_request_error",
    )
    assert "not valid JSON" in err["message"]
    envelope(httpx.get(f"{stack.base_url}/v1/nope"), 404, "not_found_error")
    envelope(httpx.get(f"{stack.base_url}/v1/completions"), 405, "invalid_request_error")


def test_unknown_model_is_404(stack: Stack) -> None:
    for path, body in [("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)]:
        err = envelope(post(stack, path, json={**body, "model": "gpt-7"}), 404, "not_found_error", "model")
        assert err["code"] == "model_not_found" and "gpt-7" in err["message"] and MODEL_NAME in err["message"]
    envelope(httpx.get(f"{stack.base_url}/v1/models/gpt-7"), 404, "not_found_error", "model")
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-7", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=-1)


def test_too_long_prompts_are_400_context_length_exceeded_with_both_numbers(stack: Stack) -> None:
    """As OpenAI and vLLM answer it: 400 invalid_request_error, code context_length_exceeded, the
    field to change as param ("messages" in a chat)."""
    limit = stack.max_model_len
    err = envelope(
        post(stack, "/v1/completions", json={**CMPL, "prompt": [5] * (limit + 44)}),
        400,
        "invalid_request_error",
        "prompt",
    )
    assert str(limit) in err["message"] and str(limit + 44) in err["message"]
    assert err["code"] == "context_length_exceeded"
    err = envelope(
        post(stack, "/v1/completions", json={**CMPL, "prompt": [5] * 200, "max_tokens": 100}),
        400,
        "invalid_request_error",
        "max_tokens",
    )
    assert f"{limit} tokens" in err["message"] and "300" in err["message"] and "at most 56" in err["message"]
    assert err["code"] == "context_length_exceeded"
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "word " * 400}]}
    err = envelope(
        post(stack, "/v1/chat/completions", json=long_chat), 400, "invalid_request_error", "messages"
    )
    assert str(limit) in err["message"] and err["code"] == "context_length_exceeded"
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": limit,
    }
    err = envelope(
        post(stack, "/v1/chat/completions", json=chat), 400, "invalid_request_error", "max_completion_tokens"
    )
    assert (
        "lower max_completion_tokens to at most" in err["message"]
        and "shorten the messages" in err["message"]
    )
    # OpenAI's own client raises BadRequestError for it, with the code to act on.
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=[5] * (limit + 1), max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    # A prompt that fits, with the rest of the context for the answer, is fine.
    ok = post(stack, "/v1/completions", json={**CMPL, "prompt": [5] * 250, "max_tokens": 6})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 6


def test_tokenize_and_detokenize(stack: Stack) -> None:
    tok = Tokenizer.from_dir(stack.model_dir)
    resp = post(stack, "/tokenize", json={"model": MODEL_NAME, "prompt": "Hello, world"}).json()
    assert resp == {"count": len(tok.encode("Hello, world")), "max_model_len": stack.max_model_len,
                    "tokens": tok.encode("Hello, world"), "token_strs": None}  # fmt: skip
    resp = post(
        stack, "/tokenize", json={"prompt": "Hello", "add_special_tokens": False, "return_token_strs": True}
    )
    assert resp.json()["tokens"] == tok.encode("Hello", add_special_tokens=False)
    assert resp.json()["token_strs"] == ["Hello"]
    messages = [{"role": "user", "content": "hi"}]
    resp = post(stack, "/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()
    assert resp["tokens"] == tok.encode_chat(messages)
    ids = tok.encode("Hello, world")
    assert post(stack, "/detokenize", json={"model": MODEL_NAME, "tokens": ids}).json() == {
        "prompt": "Hello, world"
    }
    envelope(post(stack, "/detokenize", json={"tokens": [10**6]}), 400, "invalid_request_error", "tokens")
    envelope(
        post(stack, "/tokenize", json={"model": "gpt-7", "prompt": "x"}), 404, "not_found_error", "model"
    )


def test_a_continued_final_message_and_template_variables(stack: Stack) -> None:
    """vLLM's continue_final_message (the prompt ends with the last message's text, open) and
    chat_template_kwargs, on /tokenize and chat completions; both flags together, or a template
    variable a request field sets, are 400s naming the field."""
    tok = Tokenizer.from_dir(stack.model_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The moon is"}]
    body = {"model": MODEL_NAME, "messages": messages, "add_generation_prompt": False,
            "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    want = tok.encode(tok.apply_chat_template(messages, False, True), add_special_tokens=False)
    assert post(stack, "/tokenize", json=body).json()["tokens"] == want
    assert tok.decode(want).endswith("The moon is")
    chat = post(stack, "/v1/chat/completions", json={**body, "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(want)
    for path in ("/tokenize", "/v1/chat/completions"):
        both = {**body, "add_generation_prompt": True, "max_tokens": 3}
        envelope(post(stack, path, json=both), 400, "invalid_request_error", "continue_final_message")
        taken = {**body, "chat_template_kwargs": {"tools": []}, "max_tokens": 3}
        envelope(post(stack, path, json=taken), 400, "invalid_request_error", "chat_template_kwargs")


def test_api_keys(stack: Stack, tmp_path: Path) -> None:
    proc = start_gateway(
        tmp_path, stack.model_dir, stack.redis_url, stack.prefix, "--api-key", "k1,k2", "--api-key", "k3"
    )
    try:
        url = gateway_url(stack.redis_url, stack.prefix, proc)
        wait_ready(url, [proc])
        assert httpx.get(f"{url}/health").status_code == 200  # open
        assert httpx.get(f"{url}/ready").status_code == 200  # open
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}]:
            resp = httpx.post(f"{url}/v1/completions", json=CMPL, headers=headers, timeout=30)
            err = envelope(resp, 401, "authentication_error")
            assert err["code"] == "invalid_api_key" and resp.headers["www-authenticate"] == "Bearer"
            envelope(httpx.get(f"{url}/v1/models", headers=headers), 401, "authentication_error")
        for key in ("k1", "k2", "k3"):
            ok = httpx.post(
                f"{url}/v1/completions", json=CMPL, headers={"Authorization": f"Bearer {key}"}, timeout=30
            )
            assert ok.status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL_NAME]
    finally:
        stop_process(proc)


def test_request_bodies_over_the_limit_are_413(stack: Stack, tmp_path: Path) -> None:
    proc = start_gateway(
        tmp_path, stack.model_dir, stack.redis_url, stack.prefix, "--max-request-bytes", "4096"
    )
    try:
        url = gateway_url(stack.redis_url, stack.prefix, proc)
        wait_ready(url, [proc])
        big = {**CMPL, "prompt": "x" * 5000}
        err = envelope(httpx.post(f"{url}/v1/completions", json=big, timeout=30), 413, "request_too_large")
        assert "4096 bytes" in err["message"]

        def chunks() -> Any:  # no Content-Length: the body is counted as it arrives
            body = json.dumps(big).encode()
            for i in range(0, len(body), 1000):
                yield body[i : i + 1000]

        resp = httpx.post(f"{url}/v1/completions", content=chunks(), timeout=30)
        assert resp.request.headers.get("transfer-encoding") == "chunked"
        envelope(resp, 413, "request_too_large")
        assert httpx.post(f"{url}/v1/completions", json=CMPL, timeout=30).status_code == 200
    finally:
        stop_process(proc)
