"""--reasoning-parser: a reasoning model's thinking comes back as ``reasoning``, apart from the
answer, whole and streamed (services/gateway/reasoning.py).

Units first (the splitter against outputs written out, fed whole and in every cut), then real
Qwen3-architecture workers behind two gateways each, one with ``--reasoning-parser qwen3`` and one
without (its text is the reference), on a tiny thinking checkpoint
(``yutu.engine.testing.make_thinking_checkpoint``: a chat template in Qwen3's manner, where
``enable_thinking: false`` closes the thinking in the prompt and ``open_thinking`` opens it as
DeepSeek R1's templates do), with markers that are special tokens and with markers that are text.
A grammar makes the random model write thinking where a test needs it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from gateway_support import MODEL_NAME, gateway_url, start_gateway, start_worker, stop_process, wait_ready
from yutu.engine.testing import END_THINK, THINK, make_thinking_checkpoint
from yutu.engine.tokenizer import Tokenizer

from services.gateway.prompts import template_messages
from services.gateway.reasoning import PARSERS, ReasoningSplit, Thinking
from services.gateway.responses_api import ResponseEvents, ResponsesRequest, Shell, response_object
from services.gateway.schemas import ChatMessage

QWEN3 = PARSERS["qwen3"]
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
           "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip

# (where the prompt left the output, the output) -> (reasoning, content)
CASES: list[tuple[bool | None, str, tuple[str | None, str]]] = [
    (None, "<think>plan</think>answer", ("plan", "answer")),
    (None, "\n <think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),  # Qwen3's own layout
    (None, "answer with <think>in it</think>", (None, "answer with <think>in it</think>")),
    (None, "<think>cut short", ("cut short", "")),  # max_tokens inside the thinking
    (None, "<think>", ("", "")),
    (None, "<thin", (None, "<thin")),  # a start never finished is text
    (None, "<think>a</thi", ("a</thi", "")),  # an end never finished is thinking
    (None, "<think></think>", ("", "")),
    (None, "", (None, "")),
    (True, "plan</think>answer", ("plan", "answer")),  # the prompt opened the thinking
    (True, "all thinking", ("all thinking", "")),
    (True, "<think>x</think>y", ("<think>x", "y")),
    (False, "<think>x</think>y", (None, "<think>x</think>y")),  # the prompt closed it
    (None, "<think>a</think>b</think>c", ("a", "b</think>c")),  # one end: the first
]


def streamed(opened: bool | None, pieces: list[str]) -> tuple[str, str, bool]:
    split = ReasoningSplit(Thinking(QWEN3, opened, True))
    reasoning = content = ""
    for piece in pieces:
        r, c = split.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = split.finish()
    return reasoning + r, content + c, split.reasoned


@pytest.mark.parametrize(("opened", "text", "expected"), CASES)
def test_the_split_whole_and_in_every_cut(
    opened: bool | None, text: str, expected: tuple[str | None, str]
) -> None:
    assert Thinking(QWEN3, opened, True).split(text) == expected
    reasoning, content = expected
    cuts = [[text]] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [[text[:i], text[i:j], text[j:]] for i in range(len(text)) for j in range(i, len(text))][::7]
    cuts.append(list(text))  # a character at a time
    for pieces in cuts:
        assert streamed(opened, pieces) == (reasoning or "", content, reasoning is not None), pieces


def test_nothing_is_sent_while_it_may_be_a_marker() -> None:
    split = ReasoningSplit(Thinking(QWEN3, None, True))
    assert split.feed("  <th") == ("", "")  # may open the thinking
    assert split.feed("ink>I wonder</") == ("I wonder", "")  # may close it
    assert split.feed("think>Yes") == ("", "Yes")
    assert split.feed(" it is") == ("", " it is")


def test_the_prompt_end_decides_where_the_output_starts() -> None:
    assert QWEN3.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n") is False
    assert QWEN3.opened_by("<｜Assistant｜><think>\n") is True
    assert QWEN3.opened_by("<|im_start|>assistant\n") is None
    assert QWEN3.opened_by("<|im_start|>assistant\n<think>\nLet me see,") is True  # thinking continued
    # an earlier turn's thinking does not count: only the prompt's end
    assert QWEN3.opened_by("<think>\nr\n</think>\n\nok<|im_end|>\n<|im_start|>assistant\n") is None


def test_earlier_thinking_reaches_the_template_under_both_names() -> None:
    for field in ("reasoning", "reasoning_content"):
        msg = ChatMessage.model_validate({"role": "assistant", "content": "ok", field: "thought"})
        (item,) = template_messages([msg])
        assert (item["reasoning"], item["reasoning_content"]) == ("thought", "thought")
    user = ChatMessage.model_validate({"role": "user", "content": "hi", "reasoning": "x"})
    assert "reasoning_content" not in template_messages([user])[0]  # an assistant's only


# -- a real stack ---------------------------------------------------------------------------------


class Stack:
    """One model's worker behind a gateway with ``--reasoning-parser qwen3`` (``thinking``) and
    one without (``plain``, the reference)."""

    def __init__(self, thinking: openai.OpenAI, plain: openai.OpenAI, url: str) -> None:
        self.thinking, self.plain, self.url = thinking, plain, url


def start_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, special_markers: bool
) -> Iterator[Stack]:
    name = "special" if special_markers else "text"
    model = make_thinking_checkpoint(
        tmp_path_factory.mktemp(f"thinking-model-{name}") / "tiny", special_markers
    )
    tok = Tokenizer.from_dir(model)
    assert (tok.token_to_id("</think>") == END_THINK) is special_markers
    assert (
        END_THINK in tok.special_token_ids and tok.id_to_token(END_THINK) == "</think>"
    ) is special_markers
    prefix = f"yutu-reasoning-{name}-{uuid.uuid4().hex[:8]}"
    logs = tmp_path_factory.mktemp(f"reasoning-stack-{name}")
    worker = start_worker(logs, model, redis_url, prefix)
    thinking = start_gateway(logs, model, redis_url, prefix, "--reasoning-parser", "qwen3",
                             "--tool-call-parser", "hermes")  # fmt: skip
    plain = start_gateway(logs, model, redis_url, prefix)
    clients = []
    try:
        urls = [gateway_url(redis_url, prefix, proc) for proc in (thinking, plain)]
        for url in urls:
            wait_ready(url, [worker, thinking, plain])
        clients = [openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) for url in urls]
        yield Stack(clients[0], clients[1], urls[0])
    finally:
        for client in clients:
            client.close()
        for proc in (thinking, plain, worker):
            stop_process(proc)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    """Markers that are special tokens, one each (as Qwen3's): a grammar waits for the thinking."""
    yield from start_stack(tmp_path_factory, redis_url, special_markers=True)


@pytest.fixture(scope="module")
def text_stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    """Markers of several tokens each: a grammar holds from the first token, so one can write them."""
    yield from start_stack(tmp_path_factory, redis_url, special_markers=False)


def ask(client: openai.OpenAI, **extra: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                max_tokens=40, temperature=0)  # fmt: skip
    args.update(extra)
    return args


def whole_and_streamed(client: openai.OpenAI, **args: Any) -> tuple[Any, list[Any]]:
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    return whole, chunks


def joined(chunks: list[Any], field: str, index: int = 0) -> str | None:
    """A streamed choice's deltas' ``field`` joined (None: no delta had it); both reasoning names
    agree on every delta."""
    pieces = []
    for chunk in chunks:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            value = extra.get(field) if field == "reasoning" else getattr(choice.delta, field)
            if choice.index == index and value is not None:
                pieces.append(value)
    return "".join(pieces) if pieces else None


def reasoning_of(message: Any) -> str | None:
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    return extra.get("reasoning")


def test_thinking_comes_back_apart_from_the_answer(text_stack: Stack) -> None:
    """The model writes <think>, thinks, writes </think>, answers (a grammar makes it): the
    thinking is reasoning, the answer content, whole and streamed, for every choice, each token's
    logprobs once; the plain gateway sends it all as content."""
    grammar = 'start: "<think>" "Cold, " "probably." "</think>" "It is cold."'
    args = ask(
        text_stack.thinking, n=2, logprobs=True, extra_body={"structured_outputs": {"grammar": grammar}}
    )
    whole, chunks = whole_and_streamed(text_stack.thinking, **args)
    tokens_each = whole.usage.completion_tokens // 2  # the grammar leaves both choices one way
    for choice in whole.choices:
        assert reasoning_of(choice.message) == "Cold, probably."
        assert choice.message.content == "It is cold." and choice.finish_reason == "stop"
        assert choice.logprobs is not None and len(choice.logprobs.content or []) == tokens_each
        assert joined(chunks, "reasoning", choice.index) == "Cold, probably."
        assert joined(chunks, "content", choice.index) == "It is cold."  # the role chunk's "" aside
        streamed_logprobs = [  # every token's, once, with the thinking's deltas or the answer's
            lp for c in chunks for ch in c.choices if ch.index == choice.index and ch.logprobs
            for lp in ch.logprobs.content or []
        ]  # fmt: skip
        assert len(streamed_logprobs) == tokens_each
    plain = text_stack.plain.chat.completions.create(**{**args, "n": 1})
    assert plain.choices[0].message.content == "<think>Cold, probably.</think>It is cold."
    assert reasoning_of(plain.choices[0].message) is None
    # vLLM's include_reasoning: false -- the thinking is left out, the answer as before
    hidden = {**args, "n": 1, "extra_body": {**args["extra_body"], "include_reasoning": False}}
    whole, chunks = whole_and_streamed(text_stack.thinking, **hidden)
    assert (whole.choices[0].message.content, reasoning_of(whole.choices[0].message)) == ("It is cold.", None)
    assert (joined(chunks, "content"), joined(chunks, "reasoning")) == ("It is cold.", None)
    streamed_logprobs = [
        lp for c in chunks for ch in c.choices if ch.logprobs for lp in ch.logprobs.content or []
    ]
    assert len(streamed_logprobs) == tokens_each  # the thinking's too, with the answer's first delta


def test_responses_refuse_logprobs_where_the_thinking_is_split_off(text_stack: Stack) -> None:
    """The chat completion's logprobs cover the thinking too; a Responses answer's text does not."""
    body = {"model": MODEL_NAME, "input": "Weather in Oslo?", "max_output_tokens": 4, "top_logprobs": 1}
    reply = httpx.post(f"{text_stack.url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs"
    assert "--reasoning-parser" in reply.json()["error"]["message"]


def test_responses_put_the_thinking_in_a_reasoning_item(text_stack: Stack) -> None:
    """/v1/responses' view of a thinking answer (services/gateway/responses_api.py), made from the
    thinking gateway's real chat answers: a reasoning item, then the message, whole and streamed
    (the reasoning_text events, then the output_text ones), the reasoning's tokens counted."""
    grammar = 'start: "<think>" "Cold, " "probably." "</think>" "It is cold."'
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 40,
            "temperature": 0, "structured_outputs": {"grammar": grammar}}  # fmt: skip
    whole = httpx.post(f"{text_stack.url}/v1/chat/completions", json=body, timeout=60).json()
    streamed = httpx.post(f"{text_stack.url}/v1/chat/completions", timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}).text  # fmt: skip
    shell = Shell(
        ResponsesRequest.model_validate({"model": MODEL_NAME, "input": "Weather in Oslo?"}), MODEL_NAME
    )

    def count(text: str) -> int:
        return len(text.split())

    made = response_object(shell, whole, count)
    assert [(item["type"], item["content"][0]["text"]) for item in made["output"]] == [
        ("reasoning", "Cold, probably."), ("message", "It is cold."),
    ]  # fmt: skip
    assert made["status"] == "completed" and made["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    events = ResponseEvents(shell, count)
    text = events.start() + "".join(events.feed(streamed[i : i + 7]) for i in range(0, len(streamed), 7))
    text += events.completed()
    payloads = [json.loads(e.split("\ndata: ", 1)[1]) for e in text.split("\n\n") if e]
    kinds = [p["type"] for p in payloads]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    reasoning = [p["delta"] for p in payloads if p["type"] == "response.reasoning_text.delta"]
    answer = [p["delta"] for p in payloads if p["type"] == "response.output_text.delta"]
    assert ("".join(reasoning), "".join(answer)) == ("Cold, probably.", "It is cold.")
    done = [p["item"] for p in payloads if p["type"] == "response.output_item.done"]
    assert [item["type"] for item in done] == ["reasoning", "message"]
    final = payloads[-1]
    assert final["type"] == "response.completed" and [p["sequence_number"] for p in payloads] == list(
        range(len(payloads))
    )
    assert [(i["type"], i["content"][0]["text"]) for i in final["response"]["output"]] == [
        (i["type"], i["content"][0]["text"]) for i in made["output"]
    ]
    usage = {k: v for k, v in final["response"]["usage"].items() if k != "input_tokens_details"}
    assert usage == {k: v for k, v in made["usage"].items() if k != "input_tokens_details"}  # the cache aside


@pytest.mark.parametrize(
    ("kwargs", "where"),
    [({}, "content"), ({"open_thinking": True}, "reasoning"), ({"enable_thinking": False}, "content")],
    ids=["output-decides", "prompt-opens", "prompt-closes"],
)
def test_the_prompt_says_where_free_text_goes(stack: Stack, kwargs: dict[str, Any], where: str) -> None:
    """Unconstrained greedy text (the plain gateway's, as the reference): all content where the
    prompt leaves it to the output (which does not open with <think>) or closes the thinking,
    all reasoning where the prompt opens it (no </think> comes: thinking cut short)."""
    args = ask(stack.thinking, max_tokens=16, extra_body={"chat_template_kwargs": kwargs})
    reference = stack.plain.chat.completions.create(**args).choices[0].message.content
    assert reference and "think>" not in reference
    whole, chunks = whole_and_streamed(stack.thinking, **args)
    message = whole.choices[0].message
    if where == "content":
        assert (reasoning_of(message), message.content) == (None, reference)
        assert (joined(chunks, "reasoning"), joined(chunks, "content")) == (None, reference)
    else:
        assert (reasoning_of(message), message.content) == (reference, None)
        assert (joined(chunks, "reasoning"), joined(chunks, "content") or "") == (reference, "")


def test_tool_calls_are_looked_for_in_the_answer_only(text_stack: Stack) -> None:
    """A call written inside the thinking is thinking; the one after it is a tool call."""
    call = '"<tool_call>{\\"name\\": \\"weather\\", \\"arguments\\": {\\"city\\": \\"Oslo\\"}}</tool_call>"'
    grammar = f'start: "<think>" "maybe " {call} "</think>" {call}'
    args = ask(
        text_stack.thinking,
        tools=[WEATHER],
        max_tokens=200,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    whole, chunks = whole_and_streamed(text_stack.thinking, **args)
    choice = whole.choices[0]
    assert (
        reasoning_of(choice.message)
        == 'maybe <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (found,) = choice.message.tool_calls or []
    assert (found.function.name, json.loads(found.function.arguments)) == ("weather", {"city": "Oslo"})
    assert joined(chunks, "reasoning") == reasoning_of(choice.message)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments or "")) for d in deltas if d.function] == [
        ("weather", {"city": "Oslo"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_of_thinking_text_and_a_call(text_stack: Stack) -> None:
    """/v1/responses' view of an answer that thinks, says something and calls a function (the
    thinking gateway's real chat answers, ``auto`` calls in the hermes format): a reasoning item, the
    message, a function_call item, whole and streamed in that order, the call's arguments as deltas."""
    call = '"<tool_call>{\\"name\\": \\"weather\\", \\"arguments\\": {\\"city\\": \\"Oslo\\"}}</tool_call>"'
    grammar = f'start: "<think>" "Look it up." "</think>" "Let me see. " {call}'
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 80,
            "temperature": 0, "tools": [WEATHER], "structured_outputs": {"grammar": grammar}}  # fmt: skip
    whole = httpx.post(f"{text_stack.url}/v1/chat/completions", json=body, timeout=60).json()
    streamed = httpx.post(f"{text_stack.url}/v1/chat/completions", timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}).text  # fmt: skip
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    request = {"model": MODEL_NAME, "input": "Weather in Oslo?",
               "tools": [{"type": "function", **WEATHER["function"]}]}  # fmt: skip
    shell = Shell(ResponsesRequest.model_validate(request), MODEL_NAME)
    made = response_object(shell, whole, lambda text: len(text.split()))
    (want,) = whole["choices"][0]["message"]["tool_calls"]
    assert [item["type"] for item in made["output"]] == ["reasoning", "message", "function_call"]
    assert made["output"][1]["content"][0]["text"] == "Let me see. " and made["status"] == "completed"
    fc = made["output"][2]
    assert (fc["call_id"], fc["name"], fc["arguments"], fc["status"]) == (
        want["id"], "weather", want["function"]["arguments"], "completed",
    )  # fmt: skip
    assert json.loads(fc["arguments"]) == {"city": "Oslo"} and made["tools"][0]["name"] == "weather"
    events = ResponseEvents(shell, lambda text: len(text.split()))
    text = events.start() + "".join(events.feed(streamed[i : i + 7]) for i in range(0, len(streamed), 7))
    text += events.completed()
    payloads = [json.loads(e.split("\ndata: ", 1)[1]) for e in text.split("\n\n") if e]
    added = [p["item"]["type"] for p in payloads if p["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    arguments = [p["delta"] for p in payloads if p["type"] == "response.function_call_arguments.delta"]
    (done,) = [p for p in payloads if p["type"] == "response.function_call_arguments.done"]
    assert "".join(arguments) == done["arguments"] == fc["arguments"] and done["output_index"] == 2
    final = payloads[-1]["response"]
    assert payloads[-1]["type"] == "response.completed"
    assert [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in final["output"]] == [
        {k: v for k, v in item.items() if k not in ("id", "call_id")} for item in made["output"]
    ]  # ids aside (two chat completions: new call ids)


@pytest.mark.parametrize(
    ("kwargs", "bias", "expected"),
    [
        # the prompt opened the thinking; </think> (the bias) is let through, then the JSON holds
        ({"open_thinking": True}, END_THINK, ("", "{")),
        # the output may open it: <think> (the bias) is let through, and thinking goes on unconstrained
        ({}, THINK, ("<think><think>", None)),
        # the prompt closed it: the JSON holds from the first token, the bias masked
        ({"enable_thinking": False}, END_THINK, (None, "{")),
    ],
    ids=["prompt-opens", "output-opens", "prompt-closes"],
)
def test_a_constrained_answer_waits_for_the_thinking(
    stack: Stack, kwargs: dict[str, Any], bias: int, expected: tuple[str | None, str | None]
) -> None:
    """response_format JSON with single-token markers: the grammar holds after the thinking (a
    logit bias of 100 on a marker shows where it does not yet hold: JSON alone would mask it)."""
    reasoning, content = expected
    args = ask(stack.thinking, response_format={"type": "json_object"}, max_tokens=30, logit_bias={str(bias): 100},
               extra_body={"chat_template_kwargs": kwargs})  # fmt: skip
    whole, chunks = whole_and_streamed(stack.thinking, **args)
    message, finish = whole.choices[0].message, whole.choices[0].finish_reason
    if content is None:  # thinking until max_tokens
        assert finish == "length" and message.content is None
        assert (reasoning_of(message) or "").startswith(reasoning or "")
    else:
        assert reasoning_of(message) == reasoning and message.content.startswith(content)
        if finish == "stop":  # complete JSON where it ended itself
            json.loads(message.content)
    assert (joined(chunks, "reasoning") or "") == (reasoning_of(message) or "")  # none streamed, if empty
    assert (joined(chunks, "content") or None) == message.content


def test_earlier_thinking_sent_back_is_rendered(stack: Stack) -> None:
    """An assistant message's ``reasoning`` (vLLM's newer name) renders as ``reasoning_content``."""

    def tokens(assistant: dict[str, Any]) -> list[int]:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", **assistant}]
        reply = httpx.post(
            f"{stack.url}/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=30
        )
        assert reply.status_code == 200, reply.text
        return list(reply.json()["tokens"])

    with_reasoning = tokens({"reasoning": "thought"})
    assert with_reasoning == tokens({"reasoning_content": "thought"})
    assert THINK in with_reasoning and with_reasoning != tokens({})


@pytest.mark.parametrize("kwargs", [{}, {"open_thinking": True}], ids=["output-decides", "prompt-opens"])
def test_beam_search_beams_split_whole_and_streamed(stack: Stack, kwargs: dict[str, Any]) -> None:
    """use_beam_search's beams go through the same split: each choice's reasoning and answer, whole
    and streamed (each choice whole once the search ends), alike."""
    args = ask(
        stack.thinking,
        max_tokens=6,
        n=2,
        extra_body={"use_beam_search": True, "chat_template_kwargs": kwargs},
    )
    whole, chunks = whole_and_streamed(stack.thinking, **args)
    assert len(whole.choices) == 2
    for choice in whole.choices:
        whole_split = (reasoning_of(choice.message), choice.message.content or "")  # "": the role chunk's
        assert whole_split == (
            joined(chunks, "reasoning", choice.index),
            joined(chunks, "content", choice.index),
        )
    if kwargs:  # the prompt opened the thinking: the beams think
        assert all(reasoning_of(choice.message) is not None for choice in whole.choices)
