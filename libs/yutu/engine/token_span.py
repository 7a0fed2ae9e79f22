"""The most input text one token can stand for: a proof that a prompt cannot fit, without tokenizing it.

If no token of a tokenizer can cover more than ``span.chars`` characters (``span.bytes`` UTF-8
bytes) of the text given to ``encode``, then a text of ``c`` characters (``b`` bytes) encodes to at
least ``c / span.chars`` (and ``b / span.bytes``) tokens. So ``c > max_model_len * span.chars`` proves
the prompt cannot fit the context, and a gateway may refuse it before spending seconds and memory on
tokenization. The bound must never be too small (that would refuse prompts that fit); being loose
only makes the cheap refusal start later. It is derived from ``tokenizer.json``, step by step:

1. The model's vocabulary: a token stands for its piece. Counting the piece's characters and UTF-8
   bytes over-counts, never under-counts: a byte-level BPE piece (GPT-2 / Llama 3 / Qwen2) spells
   one input byte per character (``Ġ`` is one byte, a space), so its input has at most
   ``len(piece)`` bytes and characters; a SentencePiece piece's ``▁`` stands for a space or itself;
   a byte-fallback piece ``<0xE4>`` stands for one byte; ``##`` continuation prefixes stand for
   nothing. An unknown-token piece stands for one character (4 bytes), unless unknown characters
   are fused into one token (BPE ``fuse_unk``, Unigram without byte fallback): unbounded.
2. Added tokens are matched in the raw text: their content, unless they strip the whitespace
   around them (``lstrip`` / ``rstrip``), which makes them absorb any amount of it: unbounded.
3. The normaliser runs before the model and may shorten the text: the span is multiplied by how
   much. Unicode composition (NFC / NFKC) merges at most 4 code points into one (the longest
   canonical decomposition of a composite, e.g. U+1F82, is 4) and up to 8 bytes into 2; case folding
   and decompositions map one code point to one or more, at most 4 bytes to 1 (KELVIN SIGN to "k",
   U+107A5 to one ASCII letter). String replacements shrink by pattern length over replacement
   length. Normalisers that delete text (strip, accent or control-character removal, a
   precompiled SentencePiece char map, regex replacements) make the bound unprovable.
4. Pre-tokenisers that drop text (whitespace splitters, ``Split`` with behaviour ``Removed``) make it
   unprovable too; the others only cut the text or map it one to one (byte level, metaspace).
5. A tokenizer that truncates caps the token count, so no length proves anything.

``token_span`` returns None wherever a step is unprovable: then callers must tokenize to know.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import tokenizers

_UNKNOWN_CHAR = (1, 4)  # (chars, bytes) one unknown-token stands for when not fused


@dataclass(frozen=True)
class TokenSpan:
    """The most characters and UTF-8 bytes of ``encode``'s input any one token can cover."""

    chars: int
    bytes: int

    def too_long(self, num_chars: int, num_bytes: int | None, max_tokens: int) -> bool:
        """True when a text of this size is proved to need more than ``max_tokens`` tokens.

        ``num_bytes`` may be None (not computed): then only the character count is used.
        """
        if num_chars > max_tokens * self.chars:
            return True
        return num_bytes is not None and num_bytes > max_tokens * self.bytes


def token_span(backend: tokenizers.Tokenizer) -> TokenSpan | None:
    """The span of ``backend`` (see the module docstring), or None when no bound can be proved."""
    spec: dict[str, Any] = json.loads(backend.to_str())
    if spec.get("truncation") is not None:
        return None
    shrink = _normaliser_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokeniser_keeps_text(spec.get("pre_tokenizer")):
        return None
    model = _model_span(spec.get("model") or {})
    added = _added_span(spec.get("added_tokens") or [])
    if model is None or added is None:
        return None
    chars = max(model[0], added[0]) * shrink[0]
    num_bytes = max(model[1], added[1]) * shrink[1]
    return TokenSpan(chars=max(chars, 1), bytes=max(num_bytes, 1))


def _piece_span(pieces: Iterable[str]) -> tuple[int, int]:
    chars = num_bytes = 0
    for piece in pieces:
        chars = max(chars, len(piece))
        num_bytes = max(num_bytes, len(piece.encode("utf-8", "surrogatepass")))
    return chars, num_bytes


def _model_span(model: Mapping[str, Any]) -> tuple[int, int] | None:
    kind = model.get("type")
    if kind == "BPE":
        vocab = model.get("vocab") or {}
        pieces: Iterable[str] = vocab.keys()
        unknown_fused = model.get("unk_token") is not None and bool(model.get("fuse_unk"))
        byte_fallback = bool(model.get("byte_fallback"))
    elif kind == "Unigram":
        pieces = [str(entry[0]) for entry in model.get("vocab") or []]
        # HF Unigram always fuses runs of unknown characters into one unknown token.
        unknown_fused = model.get("unk_id") is not None
        byte_fallback = bool(model.get("byte_fallback"))
    else:  # WordPiece and WordLevel map a whole unknown word, of any length, to one token
        return None
    if unknown_fused and not byte_fallback:
        return None
    chars, num_bytes = _piece_span(pieces)
    return max(chars, _UNKNOWN_CHAR[0]), max(num_bytes, _UNKNOWN_CHAR[1])


def _added_span(added: list[Mapping[str, Any]]) -> tuple[int, int] | None:
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    return _piece_span(str(token.get("content", "")) for token in added)


# (chars, bytes) factors by which a normaliser can shorten text; see the module docstring, step 3.
_NORMALISER_SHRINK = {
    "NFC": (4, 8),
    "NFKC": (4, 8),
    "NFD": (1, 4),
    "NFKD": (1, 4),
    "Lowercase": (1, 4),
    "Prepend": (1, 1),  # only adds
    "ByteLevel": (1, 1),  # one character per byte: only grows
}


def _normaliser_shrink(normaliser: Mapping[str, Any] | None) -> tuple[int, int] | None:
    if normaliser is None:
        return 1, 1
    kind = normaliser.get("type")
    if kind == "Sequence":
        chars = num_bytes = 1
        for part in normaliser.get("normalizers") or []:
            shrink = _normaliser_shrink(part)
            if shrink is None:
                return None
            chars, num_bytes = chars * shrink[0], num_bytes * shrink[1]
        return chars, num_bytes
    if kind == "Replace":
        pattern = (normaliser.get("pattern") or {}).get("String")
        content = str(normaliser.get("content", ""))
        if not isinstance(pattern, str) or not pattern or not content:
            return None  # a regex, or a deletion
        chars = math.ceil(len(pattern) / len(content))
        num_bytes = math.ceil(len(pattern.encode()) / len(content.encode()))
        return max(chars, 1), max(num_bytes, 1)
    if isinstance(kind, str) and kind in _NORMALISER_SHRINK:
        return _NORMALISER_SHRINK[kind]
    return None  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled, or unknown: may delete text


_KEEPING_PRE_TOKENISERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _pre_tokeniser_keeps_text(pre: Mapping[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_pre_tokeniser_keeps_text(p) for p in pre.get("pretokenizers") or [])
    if kind not in _KEEPING_PRE_TOKENISERS:
        return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit drop text
    return pre.get("behavior") != "Removed"
