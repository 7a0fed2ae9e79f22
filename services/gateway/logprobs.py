"""Logprobs in the two OpenAI shapes, from the generated tokens.

Completions (legacy): parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict of
token text -> logprob: the top ``logprobs`` alternatives plus the sampled token, so up to
``logprobs + 1`` entries) and ``text_offset`` (char offset of each token in the completion text).

Chat: ``content`` is a list with one entry per token: ``token``, ``logprob``, ``bytes`` (its UTF-8
bytes) and ``top_logprobs`` (exactly the top ``top_logprobs`` alternatives, best first).
"""

from __future__ import annotations

import math

from services.gateway.generation import TokenInfo
from services.gateway.schemas import ChatTokenLogprob, CompletionLogprobs, TopLogprob
from services.gateway.tokens import TokenText

_FLOOR = -9999.0  # JSON has no -inf: a logprob of -inf is shown as this (as vLLM does)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def completion_logprobs(tokens: list[TokenInfo], text: TokenText, base_offset: int = 0) -> CompletionLogprobs:
    """Completions-style logprobs of ``tokens``; ``text_offset`` values are shifted by ``base_offset``."""
    out = CompletionLogprobs()
    for tok in tokens:
        assert tok.logprob is not None, "logprobs were not asked from the worker"
        token_str = text.text_of(tok.token_id)
        out.tokens.append(token_str)
        out.token_logprobs.append(_finite(tok.logprob))
        top = {text.text_of(alt): _finite(lp) for alt, lp in tok.top}
        top.setdefault(token_str, _finite(tok.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(base_offset + tok.text_offset)
    return out


def _top(token_id: int, logprob: float, text: TokenText) -> TopLogprob:
    return TopLogprob(
        token=text.text_of(token_id), logprob=_finite(logprob), bytes=list(text.bytes_of(token_id))
    )


def chat_logprobs(tokens: list[TokenInfo], text: TokenText) -> list[ChatTokenLogprob]:
    """Chat-style logprob entries of ``tokens``."""
    out = []
    for tok in tokens:
        assert tok.logprob is not None, "logprobs were not asked from the worker"
        head = _top(tok.token_id, tok.logprob, text)
        out.append(
            ChatTokenLogprob(
                token=head.token,
                logprob=head.logprob,
                bytes=head.bytes,
                top_logprobs=[_top(alt, lp, text) for alt, lp in tok.top],
            )
        )
    return out
