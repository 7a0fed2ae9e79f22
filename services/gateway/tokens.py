"""How single tokens are shown in logprobs: their text and their UTF-8 bytes.

A byte-level BPE token (GPT-2 / Llama 3 / Qwen2 style) is spelled in tokenizer.json with the
printable-character stand-ins for bytes (``Ġ`` for a space); a SentencePiece byte-fallback token is
``<0xE4>``. We map both back to the raw bytes; any other token's bytes are its decoded text. A token
that is not valid UTF-8 on its own (half a character) is shown as OpenAI shows it: ``bytes:\\xe4``.
"""

from __future__ import annotations

import re
from functools import lru_cache

from yutu.engine.tokenizer import Tokenizer

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    decoder = tokenizer.backend.decoder
    if decoder is None:
        return False
    return "ByteLevel" in repr(decoder) or type(decoder).__name__ == "ByteLevel"


class TokenText:
    """Text and bytes of single token ids for one tokenizer (memoised)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self._special = set(tokenizer.backend.get_added_tokens_decoder())
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self.tokenizer.id_to_token(token_id)
        data: bytes
        if piece is None:
            data = b""
        elif token_id in self._special:
            data = piece.encode("utf-8")
        elif (m := _BYTE_FALLBACK.match(piece)) is not None:
            data = bytes([int(m.group(1), 16)])
        elif self.byte_level and all(ch in _unicode_to_byte() for ch in piece):
            table = _unicode_to_byte()
            data = bytes(table[ch] for ch in piece)
        elif "\u2581" in piece:  # SentencePiece word-start marker "▁" stands for a space
            data = piece.replace("\u2581", " ").encode("utf-8")
        else:
            data = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._cache[token_id] = data
        return data

    def text_of(self, token_id: int) -> str:
        data = self.bytes_of(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
