"""KV events on ZeroMQ PUB, in the wire shape of vLLM's ``vllm/distributed/kv_events.py``.

Each message is three frames::

    [topic (utf-8), seq (8-byte big-endian, starts at 0, +1 per batch), payload]

    payload = msgpack([ts, [event, ...], data_parallel_rank])      # EventBatch, array_like

    event   = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
               medium, lora_name]
            | ["BlockRemoved", block_hashes, medium]
            | ["AllBlocksCleared"]

which is what msgspec writes for vLLM's ``array_like=True, tag=True`` structs (the tag is the class
name, first). A subscriber built on vLLM's own ``KVEventBatch`` decoder reads these messages, and
:func:`decode_batch` reads vLLM's (including the map form newer vLLM versions write).

Block hashes are ``bytes`` or ``int`` (vLLM's ``ExternalBlockHash``). Yutu's block keys are hex
strings; :func:`key_to_hash` turns a hex key into its bytes (``bytes.fromhex``) and any other key
into its UTF-8 bytes, and ``hash.hex()`` gives a hex key back.

A publisher may also serve replays on a ROUTER socket, like vLLM's: a subscriber sends
``[b"", start_seq (8-byte big-endian)]`` and receives ``[b"", seq, payload]`` for every buffered
batch with ``seq >= start_seq``, then ``[b"", END_SEQ, b""]``.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any

import msgpack

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_CPU = "CPU"  # vLLM's name for host memory (the store's DRAM segments)
MEDIUM_DISK = "DISK"

BlockHash = bytes | int
_HEX = frozenset(string.hexdigits.lower())


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = MEDIUM_CPU
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_CPU


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _a_set(event: KVEvent | None) -> bool:
    """Whether ``event`` is a ``BlockStored`` of a set of blocks -- no parent, no token ids, no
    LoRA -- as the store publishes: such events may join."""
    return (
        isinstance(event, BlockStored)
        and event.parent_block_hash is None
        and not event.token_ids
        and event.lora_id is None
    )


def extend_joined(events: list[KVEvent], more: list[KVEvent]) -> None:
    """Append ``more`` to ``events`` in order, a set-of-blocks ``BlockStored`` joining the one just
    before it when that one is such an event of the same block size and medium: a batch of puts,
    or the puts of a write-behind window, make one event, not one per object (the conductor's view
    adds a set's hashes one by one). Anything in between keeps them apart, so order holds."""
    for event in more:
        last = events[-1] if events else None
        if (
            _a_set(event)
            and _a_set(last)
            and last.block_size == event.block_size  # type: ignore[union-attr]  # _a_set: BlockStored
            and last.medium == event.medium  # type: ignore[union-attr]
        ):
            last.block_hashes.extend(event.block_hashes)  # type: ignore[union-attr]
        else:
            events.append(event)


@dataclass(frozen=True)
class KVEventBatch:
    ts: float  # wall clock (time.time()) when the batch was made
    events: list[KVEvent]
    data_parallel_rank: int | None = 0


def key_to_hash(key: str) -> bytes:
    """The block hash published for object key ``key`` (hex keys become their bytes)."""
    if len(key) % 2 == 0 and key and set(key) <= _HEX:
        return bytes.fromhex(key)
    return key.encode("utf-8")


def _event_to_wire(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(batch: KVEventBatch) -> bytes:
    body: list[Any] = [batch.ts, [_event_to_wire(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:  # msgspec omit_defaults drops a None rank
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


def frames(topic: str, seq: int, batch: KVEventBatch) -> list[bytes]:
    """The multipart message for batch number ``seq``."""
    return [topic.encode("utf-8"), seq.to_bytes(8, "big"), encode_batch(batch)]


class KVEventDecodeError(ValueError):
    """A payload that is not a KV event batch."""


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)


def _event_from_wire(raw: Any) -> KVEvent:
    if isinstance(raw, dict):  # newer vLLM: tagged map {"type": tag, field: value, ...}
        tag = raw.get("type")
        values = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        values = None
    else:
        raise KVEventDecodeError(f"malformed KV event {raw!r}")
    if tag == "BlockStored":
        if values is None:
            if len(raw) < 6:
                raise KVEventDecodeError(f"BlockStored needs at least 5 fields, got {raw!r}")
            values = dict(zip(_STORED_FIELDS, raw[1:8], strict=False))
        fields: dict[str, Any] = {k: values[k] for k in _STORED_FIELDS if k in values}
        return BlockStored(**fields)
    if tag == "BlockRemoved":
        if values is None:
            if len(raw) < 2:
                raise KVEventDecodeError(f"BlockRemoved needs block_hashes, got {raw!r}")
            values = {"block_hashes": raw[1], "medium": raw[2] if len(raw) > 2 else None}
        return BlockRemoved(values["block_hashes"], values.get("medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KVEventDecodeError(f"unknown KV event tag {tag!r}")


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode the third frame of a KV event message (ours or vLLM's)."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KVEventDecodeError(f"undecodable KV event batch: {exc}") from exc
    if isinstance(body, dict):
        ts, events, rank = body.get("ts"), body.get("events"), body.get("data_parallel_rank")
    elif isinstance(body, list) and len(body) in (2, 3):
        ts, events = body[0], body[1]
        rank = body[2] if len(body) == 3 else None
    else:
        raise KVEventDecodeError(f"malformed KV event batch {body!r}")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise KVEventDecodeError(f"malformed KV event batch {body!r}")
    return KVEventBatch(float(ts), [_event_from_wire(e) for e in events], rank)
