"""Every string of a request must be valid Unicode before it reaches the tokenizer or an error message.

JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), and Python's ``json`` decodes it (and the
raw bytes ``ED A0 80``, which it reads with ``surrogatepass``) into a ``str`` that cannot be encoded
as UTF-8: the tokenizer raises ``TypeError`` on it and so does writing it into a response. A valid
surrogate pair is decoded into one code point, so any surrogate left in a decoded string is lone.
:func:`require_valid_text` walks the whole validated request (extra fields of chat messages
included) and refuses the first such string with a 400 naming its path, e.g.
``messages.0.content``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from services.gateway.errors import invalid

_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset({int, float, bool, type(None)})  # JSON values that hold no text


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in ``text``, or None (``isascii`` is O(1) in CPython)."""
    if text.isascii():
        return None
    match = _SURROGATE.search(text)
    return None if match is None else match.start()


def first_invalid_text(value: Any, path: str = "") -> tuple[str, int, str] | None:
    """(path, index, the surrogate) of the first invalid string in a JSON-like value, or None.

    Dict keys are checked too: a bad key is reported at its parent's path.
    """
    if isinstance(value, str):
        at = lone_surrogate(value)
        return None if at is None else (path or "body", at, value[at])
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and (at := lone_surrogate(key)) is not None:
                return (path or "body", at, key[at])
            found = first_invalid_text(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        if set(map(type, value)) <= _SCALARS:  # token ids: one look, not a call per id
            return None
        for i, item in enumerate(value):
            if type(item) in _SCALARS:
                continue
            found = first_invalid_text(item, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def require_valid_text(body: BaseModel) -> None:
    """Raise a 400 naming the first field of ``body`` that holds a lone surrogate."""
    found = first_invalid_text(body.model_dump(exclude_unset=True))
    if found is None:
        return
    path, at, char = found
    raise invalid(
        f"{path} is not valid Unicode text: it holds a lone UTF-16 surrogate (U+{ord(char):04X}) at"
        f" character {at}. Send real characters: one outside the Basic Multilingual Plane is written"
        " in JSON as a surrogate pair (\\ud83d\\ude00) or as UTF-8",
        path,
    )
