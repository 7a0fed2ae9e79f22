"""Plain data that crosses the store's process boundaries: replica descriptors and put options.

A replica descriptor says where one copy of an object lives: which transfer-engine segment, which
registered region inside it, at which offset, how long, and in which state. Clients turn it into a
``TransferRequest`` and nothing else; only the master creates and changes replicas.

Replica lifecycle (owned by the master)::

    ALLOCATED --(handed to a writer by put_start)--> WRITING --(put_end)--> COMPLETE
        \\______________________(put_revoke, writer timeout, node lost)______________/--> freed

Only COMPLETE replicas are ever returned to readers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

MAX_KEY_BYTES = 512


class ReplicaState(enum.StrEnum):
    ALLOCATED = "allocated"  # space reserved in a segment, not yet handed to a writer
    WRITING = "writing"  # a writer was told to fill it; invisible to readers
    COMPLETE = "complete"  # put_end confirmed the bytes; readable


class Medium(enum.StrEnum):
    DRAM = "dram"  # a region of a store node's (or client's) registered memory
    DISK = "disk"  # a file in a store node's disk tier; promoted back to DRAM before a read


_STATES: dict[str, ReplicaState] = {s.value: s for s in ReplicaState}  # cheaper than ReplicaState(s)
_MEDIA: dict[str, Medium] = {m.value: m for m in Medium}


class ReplicaDescriptor(NamedTuple):
    """Where one copy of an object lives. ``offset`` is None for a DISK replica.

    A NamedTuple: it goes on the wire as itself (msgpack writes the tuple as an array and the
    StrEnums as their values) and comes back through :meth:`from_wire`, which checks every field.
    """

    segment: str  # transfer-engine segment name
    region: str  # registered region inside the segment
    offset: int | None  # byte offset inside the region (DRAM only)
    length: int  # object size in bytes
    state: ReplicaState
    host_id: str = ""  # yutu.transfer.segment.local_host_id() of the segment's host
    medium: Medium = Medium.DRAM

    def to_wire(self) -> list[Any]:
        return list(self)

    @classmethod
    def from_wire(cls, raw: Any) -> ReplicaDescriptor:
        """Decode a replica as msgpack gives it (a list of 7); raises ``ValueError`` naming what is
        wrong with anything else."""
        try:
            segment, region, offset, length, state, host_id, medium = raw
            fields = (_STATES[state], _MEDIA[medium])
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"malformed replica descriptor {raw!r}: {exc!r}") from None
        if not (
            type(segment) is str
            and type(region) is str
            and type(length) is int
            and length >= 0
            and (offset is None or (type(offset) is int and offset >= 0))
            and type(host_id) is str
        ):
            raise ValueError(
                f"malformed replica descriptor {raw!r}: want [segment str, region str, offset int >= 0 or "
                "None, length int >= 0, state, host_id str, medium]"
            )
        return tuple.__new__(cls, (segment, region, offset, length, fields[0], host_id, fields[1]))


@dataclass(frozen=True, slots=True)
class PutOptions:
    """How to store an object (Mooncake's ReplicateConfig).

    ``replicas`` is best effort: the master places copies on distinct segments and returns fewer
    when fewer segments have room. ``soft_pin`` protects the object from eviction until the pin's
    TTL (set on the master) runs out; every read refreshes it. ``upsert`` replaces the bytes of an
    existing key; without it a put of an existing key is a no-op (idempotent).
    """

    replicas: int = 1
    soft_pin: bool = False
    upsert: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {self.replicas!r}")


def validate_key(key: Any) -> str:
    """Return ``key`` if it is a valid object key, else raise ``ValueError`` saying why."""
    if not isinstance(key, str):
        raise ValueError(f"object keys are str, got {type(key).__name__}")
    if not key:
        raise ValueError("object key is empty; use e.g. the block key hex")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise ValueError(f"object key is longer than {MAX_KEY_BYTES} bytes; use the block key hex")
    return key


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"64MiB"``, ``"1g"`` or ``"1.5GB"``; raises ``ValueError`` otherwise."""
    raw = str(text).strip().lower().replace("_", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :].strip()
    if unit not in _UNITS or not number:
        raise ValueError(f"cannot read a size from {text!r}: write e.g. 4096, 64MiB or 2GiB")
    value = float(number) * _UNITS[unit]
    if value < 0 or value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)
