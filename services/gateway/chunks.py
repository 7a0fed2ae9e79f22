"""The streamed chunks of /v1/completions and /v1/chat/completions, encoded from plain values.

A streamed token costs the gateway one chunk. Built as the response models of
:mod:`services.gateway.schemas` and dumped (:func:`services.gateway.streaming.event`), a
completions chunk with one token and its logprob takes 5.9 us (warm, in a loop); encoded here
from a dict by msgspec, 1.2 us. With the per-token metrics' label lookups made once
(``GatewayMetrics``), the gateway's CPU per streamed token went 83-90 -> 61-67 us at 16 requests
at a time and 176-195 -> 144-154 us one at a time (``loadtests/serving_cpu.py --placements
process --repeat 8``, three alternating pairs of checkouts).

The models stay the reference: the non-streaming responses, the usage and error events are built
with them, and ``tests/gateway/test_gateway_chunks.py`` holds each chunk here equal (as JSON) to
the one the models make from the same values. Floats may be written differently (``1e-07``
against ``1e-7``), never with a different value.
"""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode


def _event(payload: dict[str, Any]) -> str:
    return f"data: {_encode(payload).decode()}\n\n"


def completion_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    text: str,
    logprobs: dict[str, list[Any]] | None,
    finish_reason: str | None,
    stop_reason: str | int | None,
    usage: dict[str, Any] | None = None,
    prompt_token_ids: list[int] | None = None,
    token_ids: list[int] | None = None,
) -> str:
    """The event of one choice's update: a ``CompletionChunk`` with that one choice (``usage``:
    the response's so far, with vLLM's ``continuous_usage_stats``; the token ids, with vLLM's
    ``return_token_ids``, only where given)."""
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return _event(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage,
            "system_fingerprint": None,
        }
    )


def chat_choice(
    index: int,
    *,
    role: str | None = None,
    content: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    token_ids: list[int] | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """One ``ChatChunkChoice``: its delta holds only what is set (``ChatDelta``'s rule);
    ``logprobs`` are the ``content`` entries of ``ChatChoiceLogprobs``; ``tool_calls`` are
    ``ToolCallDelta`` s; ``token_ids`` (vLLM's ``return_token_ids``) only where given;
    ``reasoning`` under both its names."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    if reasoning is not None:
        delta["reasoning"] = delta["reasoning_content"] = reasoning
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> str:
    """The event of a ``ChatCompletionChunk`` with ``choices`` (made by :func:`chat_choice`;
    ``usage``: the response's so far, with vLLM's ``continuous_usage_stats``; ``prompt_token_ids``,
    vLLM's ``return_token_ids``, only where given)."""
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
    }
    if prompt_token_ids is not None:
        chunk["prompt_token_ids"] = prompt_token_ids
    return _event(chunk)
