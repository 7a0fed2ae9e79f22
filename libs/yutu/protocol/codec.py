"""Encoding of control messages as msgpack, with an explicit type registry per channel.

A frame is ``msgpack([channel, version, tag, {field: value}])``. Message classes are plain
dataclasses whose fields hold msgpack-native values only (int, float, str, bytes, bool, None, lists
and dicts of those); nested structure is spelled out as lists, never pickled. A decoder accepts only
the tags registered on its channel and only its own version, so a mismatched peer fails loudly with
:class:`ProtocolError` instead of misreading a message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")


class ProtocolError(ValueError):
    """A frame that is not a valid message of the expected channel and version."""


class Channel:
    """The message types of one ZeroMQ channel and their codec."""

    def __init__(self, name: str, version: int) -> None:
        self.name = name
        self.version = version
        self._by_tag: dict[str, type[Any]] = {}
        self._tag_of: dict[type[Any], str] = {}
        self._fields_of: dict[type[Any], tuple[str, ...]] = {}  # field names, read once per class

    def message(self, tag: str) -> Callable[[type[T]], type[T]]:
        """Class decorator registering a dataclass under ``tag`` on this channel."""

        def register(cls: type[T]) -> type[T]:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__} must be a dataclass to be a {self.name} message")
            if tag in self._by_tag:
                raise ValueError(f"tag {tag!r} already registered on channel {self.name}")
            self._by_tag[tag] = cls
            self._tag_of[cls] = tag
            self._fields_of[cls] = tuple(f.name for f in dataclasses.fields(cls))
            return cls

        return register

    @property
    def messages(self) -> tuple[type[Any], ...]:
        """The registered message classes, in registration order."""
        return tuple(self._tag_of)

    def encode(self, msg: Any) -> bytes:
        """The frame of ``msg``; raises TypeError if it is not a message of this channel."""
        cls = type(msg)
        tag = self._tag_of.get(cls)
        if tag is None:
            raise TypeError(f"{cls.__name__} is not a message of channel {self.name}")
        fields = {name: getattr(msg, name) for name in self._fields_of[cls]}
        return msgpack.packb([self.name, self.version, tag, fields], use_bin_type=True)

    def decode(self, frame: bytes) -> Any:
        """The message in ``frame``; raises :class:`ProtocolError` for anything else, never another error."""
        try:
            channel, version, tag, fields = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ProtocolError(f"undecodable frame on channel {self.name}: {exc}") from exc
        if channel != self.name:
            raise ProtocolError(f"frame for channel {channel!r} received on {self.name!r}")
        if version != self.version:
            raise ProtocolError(
                f"{self.name} protocol version {version} received, this process speaks {self.version}:"
                " run the same Yutu version on both sides"
            )
        cls = self._by_tag.get(tag) if isinstance(tag, str) else None
        if cls is None or not isinstance(fields, dict):
            raise ProtocolError(f"unknown message {tag!r} on channel {self.name}")
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ProtocolError(f"malformed {tag!r} message on channel {self.name}: {exc}") from exc
