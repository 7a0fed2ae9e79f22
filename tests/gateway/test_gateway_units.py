"""Pure pieces of the gateway: stop strings, token text/bytes, settings, API keys, length rules,
the event stream's close."""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from yutu.engine.tokenizer import IncrementalDetokenizer, Tokenizer

from services.gateway.auth import check_api_key
from services.gateway.errors import ApiError
from services.gateway.prompts import max_tokens_for, stop_strings
from services.gateway.settings import GatewaySettings, add_arguments, split_api_keys
from services.gateway.stop import StopMatcher
from services.gateway.streaming import EventStream
from services.gateway.tokens import TokenText


def run_matcher(
    stops: list[str], deltas: list[str], include: bool = False
) -> tuple[list[str], str | None, str]:
    m = StopMatcher(stops, include)
    shown: list[str] = []
    for d in deltas:
        text, matched = m.feed(d)
        shown.append(text)
        if matched is not None:
            return shown, matched, ""
    return shown, None, m.flush()


def test_stop_matcher_truncates_at_first_match_and_holds_partial_prefixes() -> None:
    # The stop string spans three deltas; nothing of it is ever shown.
    assert run_matcher(["STOP"], ["ab S", "T", "OP cd"]) == (["ab ", "", ""], "STOP", "")
    # A partial prefix that turns out not to be the stop string is released with the next delta.
    assert run_matcher(["STOP"], ["x ST", "y"]) == (["x ", "STy"], None, "")
    # Earliest match wins across several stop strings, even when a longer one also matches.
    assert run_matcher(["world", "o"], ["hello world"]) == (["hell"], "o", "")
    # At the end, held text comes out with flush().
    assert run_matcher(["\n\n"], ["line\n"]) == (["line"], None, "\n")
    # No stop strings: everything passes through.
    assert run_matcher([], ["a", "b"]) == (["a", "b"], None, "")
    # Overlapping prefix: "aab" with stop "ab" -> held "a", then match.
    assert run_matcher(["ab"], ["a", "a", "b"]) == (["", "a", ""], "ab", "")


def test_stop_matcher_can_keep_the_stop_string_it_reached() -> None:
    """vLLM's include_stop_str_in_output: the text ends with the stop string, nothing after it."""
    assert run_matcher(["STOP"], ["ab S", "T", "OP cd"], include=True) == (["ab ", "", "STOP"], "STOP", "")
    assert run_matcher(["world", "o"], ["hello world"], include=True) == (["hello"], "o", "")
    assert run_matcher(["ab"], ["a", "a", "b"], include=True) == (["", "a", "ab"], "ab", "")
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher([""])


def test_token_text_bytes_concatenate_to_the_utf8_text(tiny_model: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model)
    text = "Hello, world! 你好 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    tt = TokenText(tok)
    assert tt.byte_level
    assert b"".join(tt.bytes_of(i) for i in ids) == text.encode("utf-8")
    # A token holding part of a character is shown the OpenAI way.
    partial = [i for i in ids if not _valid_utf8(tt.bytes_of(i))]
    assert partial, "the tiny tokenizer splits Chinese characters into byte tokens"
    assert tt.text_of(partial[0]).startswith("bytes:\\x")
    assert tt.text_of(ids[0]) == "Hello"
    assert tt.bytes_of(tok.eos_token_ids[0]) == b"<|eot_id|>"
    # The detokenizer's deltas (what the gateway streams) rebuild the same text.
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == text


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_settings_from_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert split_api_keys(["a", "b,c", " ", "a"]) == ("a", "b", "c")
    assert split_api_keys("k1, k2") == ("k1", "k2")
    assert split_api_keys(None) == ()

    def parse(argv: list[str]) -> GatewaySettings:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return GatewaySettings.from_args(parser.parse_args(argv))

    s = parse([])
    assert (s.port, s.host, s.api_keys, s.model, s.served_model_name) == (8000, "127.0.0.1", (), None, None)
    monkeypatch.setenv("YUTU_API_KEY", "env1,env2")
    monkeypatch.setenv("YUTU_GATEWAY_PORT", "9001")
    s = parse([])
    assert (s.port, s.api_keys) == (9001, ("env1", "env2"))
    s = parse(["--api-key", "f1", "--api-key", "f2,f3", "--port", "0"])  # flags replace the env keys
    assert (s.port, s.api_keys) == (0, ("f1", "f2", "f3"))
    with pytest.raises(ValueError, match="--port"):
        parse(["--port", "70000"])


def test_api_key_check() -> None:
    check_api_key(None, ())  # no keys: open
    check_api_key("Bearer k2", ("k1", "k2"))
    check_api_key("bearer  k1 ", ("k1",))
    for header, fragment in [
        (None, "didn't provide"),
        ("Basic k1", "didn't provide"),
        ("Bearer nope", "Incorrect"),
    ]:
        with pytest.raises(ApiError, match=fragment) as info:
            check_api_key(header, ("k1",))
        assert (info.value.status, info.value.type, info.value.code) == (
            401,
            "authentication_error",
            "invalid_api_key",
        )


def test_context_length_rules() -> None:
    assert max_tokens_for(10, None, 16, 100) == 16
    assert max_tokens_for(90, None, 16, 100) == 10  # the default is clipped to the room left
    assert max_tokens_for(90, None, None, 100) == 10  # chat: up to the context
    assert max_tokens_for(90, 10, 16, 100) == 10
    with pytest.raises(ApiError) as info:
        max_tokens_for(90, 11, 16, 100)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert "100" in info.value.message and "101" in info.value.message and "at most 10" in info.value.message
    with pytest.raises(ApiError) as info:
        max_tokens_for(100, None, 16, 100)
    assert info.value.status == 400 and "100 tokens" in info.value.message and info.value.param == "prompt"
    with pytest.raises(ApiError) as info:
        max_tokens_for(100, None, None, 100, "messages", "max_completion_tokens")
    assert info.value.param == "messages" and "shorten the messages" in info.value.message
    assert stop_strings("x") == ("x",) and stop_strings(None) == ()
    with pytest.raises(ApiError, match="non-empty"):
        stop_strings(["a", ""])


async def _events(iterated: list[str]) -> AsyncIterator[str]:
    for chunk in ("data: 1\n\n", "data: [DONE]\n\n"):
        iterated.append(chunk)
        yield chunk


async def _call(response: EventStream, fail_on_send: bool) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(10)  # the client never hangs up by itself here
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if fail_on_send:
            raise OSError("the client is gone")
        sent.append(message)

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    try:
        await response(scope, receive, send)
    except Exception:  # noqa: BLE001 - starlette's ClientDisconnect; what matters is on_close
        pass
    return sent


async def test_event_stream_closes_its_generation_however_it_ends() -> None:
    """The generation starts before its response: closed once the body is sent, and also when the
    client is gone before the body's first chunk (the body iterator then never runs)."""
    iterated: list[str] = []
    closed: list[str] = []
    sent = await _call(EventStream(_events(iterated), lambda: closed.append("sent"), {"x-a": "1"}), False)
    assert sent[0]["type"] == "http.response.start" and (b"x-a", b"1") in sent[0]["headers"]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]
    assert closed == ["sent"] and len(iterated) == 2

    iterated.clear()
    assert await _call(EventStream(_events(iterated), lambda: closed.append("gone"), {}), True) == []
    assert closed == ["sent", "gone"] and iterated == []  # never iterated, still closed


def test_a_moved_request_asks_for_its_prompt_logprobs_only_if_they_have_not_gone_out() -> None:
    """Prompt logprobs go out with the first token: a request moved after it (tokens streamed) no
    longer asks for them (the engine would refuse a request carrying generated tokens that does),
    one moved before it still does; the request's own sampling is not changed."""
    from yutu.protocol.generate import GenerateRequest

    from services.gateway.routing import _moved

    sampling = {"max_tokens": 8, "prompt_logprobs": 1, "logprobs": 1}
    request = GenerateRequest("r", [1, 2, 3], sampling, 0.0)
    after = _moved(request, 1, [5, 6])
    assert after.sampling == {"max_tokens": 8, "prompt_logprobs": None, "logprobs": 1}
    assert after.generated == [5, 6] and after.request_id == "r-m1"
    assert _moved(request, 1, []).sampling == sampling
    assert request.sampling["prompt_logprobs"] == 1


async def test_the_chat_template_sees_the_tools_and_call_arguments_as_objects(tiny_model: Path) -> None:
    """``tools`` reach the template as its variable, and an earlier assistant turn's tool-call
    arguments (JSON text on the wire) as an object, as transformers' templates read them."""
    from services.gateway.memory import MemoryReleaser
    from services.gateway.prompts import chat_prompt
    from services.gateway.schemas import ChatMessage
    from services.gateway.tokenization import PromptTokenizer

    tok = Tokenizer.from_dir(tiny_model)
    tok.chat_template = (
        "{% for t in tools %}{{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}"
        "{% endfor %}"
    )
    prompts = PromptTokenizer(tok, threads=1, releaser=MemoryReleaser())
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [ChatMessage(role="assistant", content=None, tool_calls=[call])]
    tools = [
        {"type": "function", "function": {"name": "weather"}},
        {"type": "function", "function": {"name": "now"}},
    ]
    try:
        ids = await chat_prompt(messages, prompts, tools=tools)
    finally:
        prompts.close()
    assert tok.decode(ids) == "weather;now;Paris"
    assert messages[0].model_dump()["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


async def test_a_grammar_compiles_off_the_event_loop_once_then_comes_from_the_cache(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A constraint the gateway's cache lacks compiles on a tokenizer-pool thread, not on the event
    loop that streams the other responses (a large schema takes tens to hundreds of milliseconds);
    the same spec again comes from the cache; one that does not compile is a 400 naming its field,
    every time (not cached)."""
    from yutu.engine.structured import LRUCache, grammar_from

    from services.gateway import structured
    from services.gateway.memory import MemoryReleaser
    from services.gateway.schemas import CompletionRequest
    from services.gateway.tokenization import PromptTokenizer

    threads: list[str] = []
    real = structured._compile

    def spy(kind: Any, text: str, whitespace: str | None) -> str:
        threads.append(threading.current_thread().name)
        return real(kind, text, whitespace)

    monkeypatch.setattr(structured, "_compile", spy)
    monkeypatch.setattr(
        structured, "_compiled", LRUCache(4, 2**20, lambda key, grammar: len(key[1]) + len(grammar))
    )
    prompts = PromptTokenizer(Tokenizer.from_dir(tiny_model), threads=1, releaser=MemoryReleaser())
    schema = {"type": "object", "properties": {"moon": {"type": "integer"}}, "required": ["moon"]}
    try:
        request = CompletionRequest(model="m", prompt="x", guided_json=schema)
        first = await structured.grammar_for(request, prompts)
        assert await structured.grammar_for(request, prompts) == first == grammar_from("json_schema", schema)
        assert len(threads) == 1 and threads[0].startswith("tokenize")
        assert threads[0] != threading.current_thread().name
        bad = CompletionRequest(model="m", prompt="x", guided_regex="((")
        for _ in range(2):
            with pytest.raises(ApiError, match="unclosed group") as refused:
                await structured.grammar_for(bad, prompts)
            assert refused.value.status == 400 and refused.value.param == "guided_regex"
        assert len(threads) == 3
    finally:
        prompts.close()


async def test_documents_and_template_kwargs_reach_the_chat_template(tiny_model: Path) -> None:
    """vLLM's ``documents`` and ``chat_template_kwargs`` become template variables; the kwargs may
    not set what the request's own fields do (documents included)."""
    from services.gateway.memory import MemoryReleaser
    from services.gateway.prompts import chat_prompt
    from services.gateway.schemas import ChatMessage
    from services.gateway.tokenization import PromptTokenizer

    tok = Tokenizer.from_dir(tiny_model)
    tok.chat_template = "{% for d in documents or [] %}[{{ d.title }}]{% endfor %}{{ mood }}"
    prompts = PromptTokenizer(tok, threads=1, releaser=MemoryReleaser())
    messages = [ChatMessage(role="user", content="hi")]
    try:
        ids = await chat_prompt(
            messages, prompts, template_kwargs={"mood": "calm"}, documents=[{"title": "moon"}]
        )
        assert tok.decode(ids) == "[moon]calm"
        with pytest.raises(ApiError, match="may not set documents") as refused:
            await chat_prompt(messages, prompts, template_kwargs={"documents": []})
        assert refused.value.param == "chat_template_kwargs"
    finally:
        prompts.close()


def test_the_wire_carries_every_sampling_field() -> None:
    """A choice's SamplingParams go to the worker as a dict of every field, and come back equal
    (a field added to SamplingParams and forgotten here would reach no worker)."""
    from yutu.engine.sampling import SamplingParams

    from services.gateway.generation import _sampling_dict
    from services.gateway.prompts import ChoiceSpec

    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3, max_tokens=9, min_tokens=2,
        stop_token_ids=(4,), ignore_eos=True, logprobs=2, prompt_logprobs=1, logit_bias=((5, 1.5),),
        repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.3, grammar="start: /a+/",
        allowed_token_ids=(7, 8), bad_words=((9,), (10, 11)), grammar_after_thinking=(12, 13, True),
    )  # fmt: skip
    assert all(getattr(params, f) != v.default for f, v in SamplingParams.__dataclass_fields__.items())
    wire = _sampling_dict(ChoiceSpec(0, 0, [1, 2], params, ()))
    assert set(wire) == set(SamplingParams.__dataclass_fields__)
    assert SamplingParams(**wire) == params


def test_bad_words_encode_as_vllm_encodes_them(tiny_model: Path) -> None:
    """Each word as it encodes alone (leading spaces dropped), and after a space where that gives
    as many tokens and a different first one (the word mid-text); a word of no tokens is a 400."""
    from services.gateway.prompts import bad_word_ids

    tok = Tokenizer.from_dir(tiny_model)

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special_tokens=False))

    words = ["moon", "  rabbit", "the moon", "x"]
    got = bad_word_ids(words, tok)
    want: list[tuple[int, ...]] = []
    for word in words:
        bare, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        want += [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
    assert got == tuple(want) and got[0] == encode("moon") and encode("rabbit") in got
    assert any(len(seq) > 1 for seq in got)  # "the moon" is two words at least
    assert bad_word_ids(None, tok) == bad_word_ids([], tok) == ()
    with pytest.raises(ApiError) as refused:
        bad_word_ids(["moon", "   "], tok)
    assert refused.value.status == 400 and refused.value.param == "bad_words.1"


async def test_add_special_tokens_puts_the_bos_first_once(tiny_model: Path) -> None:
    """vLLM's chat ``add_special_tokens``: the tokenizer's BOS before a rendered prompt whose template
    did not put it there; one the template put is not doubled; unasked, nothing is added."""
    from services.gateway.memory import MemoryReleaser
    from services.gateway.prompts import chat_prompt
    from services.gateway.schemas import ChatMessage
    from services.gateway.tokenization import PromptTokenizer

    tok = Tokenizer.from_dir(tiny_model)
    bos = tok.bos_token_id
    assert bos is not None
    messages = [ChatMessage(role="user", content="hi")]
    bare = Tokenizer.from_dir(tiny_model)
    bare.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # no BOS of its own
    prompts = PromptTokenizer(tok, threads=1, releaser=MemoryReleaser())
    bare_prompts = PromptTokenizer(bare, threads=1, releaser=MemoryReleaser())
    try:
        with_bos = await chat_prompt(messages, prompts, add_special_tokens=True)
        assert with_bos == await chat_prompt(messages, prompts) and with_bos[0] == bos  # the template's own
        assert await chat_prompt(messages, bare_prompts) == tok.encode("hi", add_special_tokens=False)
        added = await chat_prompt(messages, bare_prompts, add_special_tokens=True)
        assert added == [bos, *tok.encode("hi", add_special_tokens=False)]
    finally:
        prompts.close()
        bare_prompts.close()
