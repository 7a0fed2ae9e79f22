"""Logprobs in the two OpenAI shapes, from the generated tokens.

Completions (legacy): parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict of
token text -> logprob: the top ``logprobs`` alternatives plus the sampled token, so up to
``logprobs + 1`` entries) and ``text_offset`` (char offset of each token in the completion text).

Chat: ``content`` is a list with one entry per token: ``token``, ``logprob``, ``bytes`` (its UTF-8
bytes) and ``top_logprobs`` (exactly the top ``top_logprobs`` alternatives, best first).

Both are built as plain values in the shape of the response models (``CompletionLogprobs``,
``ChatTokenLogprob``): a streamed chunk encodes them as they are (:mod:`services.gateway.chunks`),
a whole response validates them into its models.
"""

from __future__ import annotations

import math
from typing import Any

from services.gateway.generation import TokenInfo
from services.gateway.tokens import TokenText

_FLOOR = -9999.0  # JSON has no -inf: a logprob of -inf is shown as this (as vLLM does)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def _name(token_id: int, text: TokenText, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text.text_of(token_id)


def completion_logprobs(
    tokens: list[TokenInfo], text: TokenText, as_ids: bool = False
) -> dict[str, list[Any]]:
    """Completions-style logprobs of ``tokens`` (``as_ids``: tokens named "token_id:<id>", as vLLM),
    a ``CompletionLogprobs`` as plain values."""
    names: list[str] = []
    logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for tok in tokens:
        assert tok.logprob is not None, "logprobs were not asked from the worker"
        token_str = _name(tok.token_id, text, as_ids)
        names.append(token_str)
        logprobs.append(_finite(tok.logprob))
        top = {_name(alt, text, as_ids): _finite(lp) for alt, lp in tok.top}
        top.setdefault(token_str, _finite(tok.logprob))
        tops.append(top)
        offsets.append(tok.text_offset)
    return {"tokens": names, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _top(token_id: int, logprob: float, text: TokenText, as_ids: bool) -> dict[str, Any]:
    return {
        "token": _name(token_id, text, as_ids),
        "logprob": _finite(logprob),
        "bytes": list(text.bytes_of(token_id)),
    }


def chat_logprobs(tokens: list[TokenInfo], text: TokenText, as_ids: bool = False) -> list[dict[str, Any]]:
    """Chat-style logprob entries of ``tokens`` (``as_ids``: tokens named "token_id:<id>"), each a
    ``ChatTokenLogprob`` as plain values."""
    out = []
    for tok in tokens:
        assert tok.logprob is not None, "logprobs were not asked from the worker"
        entry = _top(tok.token_id, tok.logprob, text, as_ids)
        entry["top_logprobs"] = [_top(alt, lp, text, as_ids) for alt, lp in tok.top]
        out.append(entry)
    return out
