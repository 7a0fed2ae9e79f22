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


def _name(token_id: int, text: TokenText, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text.text_of(token_id)


def completion_logprobs(tokens: list[TokenInfo], text: TokenText, as_ids: bool = False) -> CompletionLogprobs:
    """Completions-style logprobs of ``tokens`` (``as_ids``: tokens named "token_id:<id>", as vLLM)."""
    out = CompletionLogprobs()
    for tok in tokens:
        assert tok.logprob is not None, "logprobs were not asked from the worker"
        token_str = _name(tok.token_id, text, as_ids)
        out.tokens.append(token_str)
        out.token_logprobs.append(_finite(tok.logprob))
        top = {_name(alt, text, as_ids): _finite(lp) for alt, lp in tok.top}
        top.setdefault(token_str, _finite(tok.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(tok.text_offset)
    return out


def _top(token_id: int, logprob: float, text: TokenText, as_ids: bool) -> TopLogprob:
    return TopLogprob(
        token=_name(token_id, text, as_ids), logprob=_finite(logprob), bytes=list(text.bytes_of(token_id))
    )


def chat_logprobs(tokens: list[TokenInfo], text: TokenText, as_ids: bool = False) -> list[ChatTokenLogprob]:
    """Chat-style logprob entries of ``tokens`` (``as_ids``: tokens named "token_id:<id>")."""
    out = []
    for tok in tokens:
        assert tok.logprob is not None, "logprobs were not asked from the worker"
        head = _top(tok.token_id, tok.logprob, text, as_ids)
        out.append(
            ChatTokenLogprob(
                token=head.token,
                logprob=head.logprob,
                bytes=head.bytes,
                top_logprobs=[_top(alt, lp, text, as_ids) for alt, lp in tok.top],
            )
        )
    return out
