"""Checks for nested parts of wire messages: decode a list into a typed structure or refuse it.

Messages on a channel are dataclasses of msgpack-native values (see :mod:`yutu.protocol.codec`).
A nested part (a KV handle, a prefix plan) travels as a list and is decoded with its type's
``from_wire``, which uses these helpers so that a malformed part raises :class:`ProtocolError`
naming the field, instead of surfacing later as a ``TypeError`` deep in a handler.
"""

from __future__ import annotations

from typing import Any

from yutu.protocol.codec import ProtocolError


def fields_of(raw: Any, names: tuple[str, ...], what: str) -> dict[str, Any]:
    """``raw`` as a list of exactly ``len(names)`` values, keyed by ``names``."""
    if not isinstance(raw, list | tuple) or len(raw) != len(names):
        raise ProtocolError(f"{what} must be a list of {len(names)} fields ({', '.join(names)}), got {raw!r}")
    return dict(zip(names, raw, strict=True))


def int_field(value: Any, name: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise ProtocolError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def float_field(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ProtocolError(f"{name} must be a number, got {value!r}")
    return float(value)


def str_field(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{name} must be a non-empty string, got {value!r}")
    return value


def int_list(value: Any, name: str, minimum: int = 0) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= minimum for v in value):
        raise ProtocolError(f"{name} must be a list of integers >= {minimum}, got {str(value)[:80]}")
    return value
