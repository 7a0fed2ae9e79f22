"""The streamed chunks encoded from plain values (services.gateway.chunks) against the reference:
the same chunk built with the response models and dumped by ``event``."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from services.gateway.chunks import chat_choice, chat_chunk, completion_chunk
from services.gateway.schemas import (
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    PromptTokensDetails,
    Usage,
)
from services.gateway.streaming import event

TEXTS = ["", "ab", ' "quoted" \\ back\nslash\t\x01\x7f', "é 中 😀 </script>", "token_id:17"]
STOPS: list[tuple[str | None, str | int | None]] = [
    (None, None),
    ("length", None),
    ("stop", "###"),
    ("stop", 13),
]
COMPLETION_LOGPROBS: list[dict[str, list[Any]] | None] = [
    None,
    {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []},
    {
        "tokens": ["ab", "token_id:9"],
        "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"ab": -0.5, "c": -1.25, '"q"': -3.0}, {"token_id:9": -9999.0}],
        "text_offset": [0, 2],
    },
]
CHAT_LOGPROBS: list[list[dict[str, Any]] | None] = [
    None,
    [],
    [
        {
            "token": "é",
            "logprob": -0.75,
            "bytes": [195, 169],
            "top_logprobs": [
                {"token": "é", "logprob": -0.75, "bytes": [195, 169]},
                {"token": "x", "logprob": -2.0, "bytes": [120]},
            ],
        },
        {"token": "token_id:3", "logprob": -9999.0, "bytes": [], "top_logprobs": []},
    ],
]


def _same(fast: str, reference: str) -> None:
    assert fast.startswith("data: ") and fast.endswith("\n\n")
    assert json.loads(fast[len("data: ") :]) == json.loads(reference[len("data: ") :])
    assert fast == reference  # these values write alike too (no float needs an exponent)


@pytest.mark.parametrize("text, stop, logprobs", list(itertools.product(TEXTS, STOPS, COMPLETION_LOGPROBS)))
def test_completion_chunk_matches_the_models(
    text: str, stop: tuple[str | None, str | int | None], logprobs: dict[str, list[Any]] | None
) -> None:
    finish_reason, stop_reason = stop
    reference = event(
        CompletionChunk(
            id="cmpl-0123abcd",
            created=1796504664,
            model="org/model-7b",
            choices=[
                CompletionChoice(
                    index=2,
                    text=text,
                    logprobs=None if logprobs is None else CompletionLogprobs.model_validate(logprobs),
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                )
            ],
        )
    )
    fast = completion_chunk(
        "cmpl-0123abcd", 1796504664, "org/model-7b", 2, text, logprobs, finish_reason, stop_reason
    )
    _same(fast, reference)


def _chat_reference(choice: ChatChunkChoice) -> str:
    return event(ChatCompletionChunk(id="chatcmpl-9f", created=17, model="m", choices=[choice]))


@pytest.mark.parametrize("text, logprobs", list(itertools.product(TEXTS, CHAT_LOGPROBS)))
def test_chat_content_chunk_matches_the_models(text: str, logprobs: list[dict[str, Any]] | None) -> None:
    lp = None if logprobs is None else ChatChoiceLogprobs.model_validate({"content": logprobs})
    reference = _chat_reference(ChatChunkChoice(index=1, delta=ChatDelta(content=text), logprobs=lp))
    _same(chat_chunk("chatcmpl-9f", 17, "m", [chat_choice(1, content=text, logprobs=logprobs)]), reference)


def test_chat_role_chunk_matches_the_models() -> None:
    reference = _chat_reference(ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content="")))
    _same(chat_chunk("chatcmpl-9f", 17, "m", [chat_choice(0, role="assistant", content="")]), reference)


@pytest.mark.parametrize("stop", STOPS[1:])
def test_chat_end_chunk_matches_the_models(stop: tuple[str, str | int | None]) -> None:
    finish_reason, stop_reason = stop
    reference = _chat_reference(
        ChatChunkChoice(index=3, delta=ChatDelta(), finish_reason=finish_reason, stop_reason=stop_reason)
    )
    fast = chat_chunk(
        "chatcmpl-9f", 17, "m", [chat_choice(3, finish_reason=finish_reason, stop_reason=stop_reason)]
    )
    _same(fast, reference)


def test_a_float_may_be_written_otherwise_but_not_valued_otherwise() -> None:
    logprobs = {
        "tokens": ["a"],
        "token_logprobs": [-1e-07],
        "top_logprobs": [{"a": -1e-07}],
        "text_offset": [0],
    }
    reference = event(
        CompletionChunk(
            id="c", created=1, model="m",
            choices=[CompletionChoice(index=0, text="a", logprobs=CompletionLogprobs.model_validate(logprobs))],
        )
    )  # fmt: skip
    fast = completion_chunk("c", 1, "m", 0, "a", logprobs, None, None)
    assert json.loads(fast[len("data: ") :]) == json.loads(reference[len("data: ") :])


def test_chunks_with_the_usage_so_far_match_the_models() -> None:
    """vLLM's continuous_usage_stats: a chunk's usage, as the models write it."""
    usage = Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=0))  # fmt: skip
    reference = event(
        CompletionChunk(
            id="c",
            created=1,
            model="m",
            usage=usage,
            choices=[
                CompletionChoice(index=0, text="a", logprobs=None, finish_reason=None, stop_reason=None)
            ],
        )  # fmt: skip
    )
    _same(completion_chunk("c", 1, "m", 0, "a", None, None, None, usage.model_dump()), reference)
    chat = event(ChatCompletionChunk(id="chatcmpl-9f", created=17, model="m", usage=usage,
                                     choices=[ChatChunkChoice(index=0, delta=ChatDelta(content="a"))]))  # fmt: skip
    _same(chat_chunk("chatcmpl-9f", 17, "m", [chat_choice(0, content="a")], usage.model_dump()), chat)


@pytest.mark.parametrize("prompt_ids", [None, [1, 2, 3]])
@pytest.mark.parametrize("ids", [[], [7], [7, 8]])
def test_chunks_with_token_ids_match_the_models(prompt_ids: list[int] | None, ids: list[int]) -> None:
    """vLLM's return_token_ids: a choice's first chunk carries its prompt's ids, every chunk its
    tokens' (chat: the prompt's on the role chunk, the response's field); unasked, no such keys."""
    reference = event(
        CompletionChunk(
            id="c", created=1, model="m",
            choices=[CompletionChoice(index=0, text="a", prompt_token_ids=prompt_ids, token_ids=ids)],
        )
    )  # fmt: skip
    _same(completion_chunk("c", 1, "m", 0, "a", None, None, None, None, prompt_ids, ids), reference)
    chat = _chat_reference(ChatChunkChoice(index=2, delta=ChatDelta(content="a"), token_ids=ids))
    _same(chat_chunk("chatcmpl-9f", 17, "m", [chat_choice(2, content="a", token_ids=ids)]), chat)
    role = event(
        ChatCompletionChunk(
            id="chatcmpl-9f", created=17, model="m", prompt_token_ids=prompt_ids,
            choices=[ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))],
        )
    )  # fmt: skip
    fast = chat_chunk(
        "chatcmpl-9f", 17, "m", [chat_choice(0, role="assistant", content="")], None, prompt_ids
    )
    _same(fast, role)
    unasked = completion_chunk("c", 1, "m", 0, "a", None, None, None)
    assert "token_ids" not in unasked and "token_ids" not in chat_chunk(
        "x", 1, "m", [chat_choice(0, content="a")]
    )
