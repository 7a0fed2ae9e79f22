"""Logprobs in the two OpenAI shapes, from the generated tokens.

Completions (legacy): parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict of
token text -> logprob: the top ``logprobs`` alternatives plus the sampled token, so up to
``logprobs + 1`` entries) and ``text_offset`` (char offset of each token in the completion text).
With ``echo`` the prompt's tokens come first, the first of them with null logprobs.

Chat: ``content`` is a list with one entry per token: ``token``, ``logprob``, ``bytes`` (its UTF-8
bytes) and ``top_logprobs`` (exactly the top ``top_logprobs`` alternatives, best first).

vLLM's ``prompt_logprobs`` (either API): one entry per prompt token, the first null, each a dict from
token id (a JSON key: a string) to its ``logprob``, ``rank`` (1: the most likely) and
``decoded_token``: the prompt's token, then the alternatives asked for.

All are built as plain values in the shape of the response models (``CompletionLogprobs``,
``ChatTokenLogprob``): a streamed chunk encodes them as they are (:mod:`services.gateway.chunks`),
a whole response validates them into its models.
"""

from __future__ import annotations

import math
from typing import Any

from yutu.engine.tokenizer import IncrementalDetokenizer, Tokenizer

from services.gateway.generation import TokenInfo
from services.gateway.tokens import TokenText

_FLOOR = -9999.0  # JSON has no -inf: a logprob of -inf is shown as this (as vLLM does)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def _name(token_id: int, text: TokenText, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text.text_of(token_id)


def _top_dict(
    token_str: str, logprob: float, alts: list[tuple[int, float]], text: TokenText, as_ids: bool
) -> dict[str, float]:
    """A completions-style ``top_logprobs`` entry: the alternatives, then the token itself."""
    top = {_name(alt, text, as_ids): _finite(lp) for alt, lp in alts}
    top.setdefault(token_str, _finite(logprob))
    return top


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
        tops.append(_top_dict(token_str, tok.logprob, tok.top, text, as_ids))
        offsets.append(tok.text_offset)
    return {"tokens": names, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(
    prompt_ids: list[int],
    entries: list[Any],
    tokenizer: Tokenizer,
    text: TokenText,
    k: int,
    as_ids: bool = False,
) -> dict[str, list[Any]]:
    """Completions-style logprobs of an echoed prompt (``echo`` with ``logprobs`` = ``k``): ``entries``
    one per prompt token as a worker sends them (``TokenDelta.prompt_logprobs``: the first None, which
    nothing comes before, shown as null as OpenAI and vLLM show it; their alternatives may be more
    than ``k`` where ``prompt_logprobs`` asked more), offsets in the prompt's text."""
    names: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    detok = IncrementalDetokenizer(tokenizer, [])
    offset = 0
    for token_id, entry in zip(prompt_ids, entries, strict=True):
        token_str = _name(token_id, text, as_ids)
        names.append(token_str)
        offsets.append(offset)
        offset += len(detok.push([token_id]))
        if entry is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(_finite(float(entry[1])))
        alts = [(int(alt), float(lp)) for alt, lp in entry[2][:k]]
        tops.append(_top_dict(token_str, float(entry[1]), alts, text, as_ids))
    return {"tokens": names, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(
    prompt_ids: list[int], entries: list[Any], text: TokenText, k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` with ``k`` alternatives, from ``entries`` as a worker sends them
    (one per prompt token, the first None; the rank of the prompt's token last)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(prompt_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        item = {
            str(token_id): {
                "logprob": _finite(float(entry[1])),
                "rank": entry[3],
                "decoded_token": text.text_of(token_id),
            }
        }
        for rank, (alt, lp) in enumerate(entry[2][:k], start=1):
            item[str(alt)] = {"logprob": _finite(float(lp)), "rank": rank, "decoded_token": text.text_of(alt)}
        out.append(item)
    return out


def joined(echoed: dict[str, list[Any]], generated: dict[str, list[Any]], shift: int) -> dict[str, list[Any]]:
    """An echoed prompt's logprobs followed by the generated tokens', whose offsets move by ``shift``
    (the echoed text's length)."""
    out = {key: echoed[key] + generated[key] for key in ("tokens", "token_logprobs", "top_logprobs")}
    out["text_offset"] = echoed["text_offset"] + [o + shift for o in generated["text_offset"]]
    return out


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
