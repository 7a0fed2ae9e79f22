"""The KV event wire shape (vLLM's msgspec array_like tagged structs), pinned to exact msgpack."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from yutu.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
    extend_joined,
    frames,
    key_to_hash,
)


def test_batch_encodes_as_vllm_array_like_tagged_structs() -> None:
    h = bytes(range(16))
    batch = KVEventBatch(
        12.5,
        [BlockStored([h], block_size=16), BlockRemoved([h, 7]), AllBlocksCleared()],
        data_parallel_rank=3,
    )
    assert msgpack.unpackb(encode_batch(batch)) == [
        12.5,
        [
            ["BlockStored", [h], None, [], 16, None, "CPU", None],
            ["BlockRemoved", [h, 7], "CPU"],
            ["AllBlocksCleared"],
        ],
        3,
    ]
    topic, seq, payload = frames("kv", 258, batch)
    assert topic == b"kv" and seq == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert decode_batch(payload) == batch


def test_decodes_older_and_newer_vllm_shapes() -> None:
    old = msgpack.packb([1.0, [["BlockStored", [1, 2], None, [5, 6], 16, None], ["BlockRemoved", [3]]]])
    decoded = decode_batch(old)
    assert decoded.data_parallel_rank is None
    assert decoded.events == [BlockStored([1, 2], None, [5, 6], 16, None), BlockRemoved([3], None)]
    new = msgpack.packb(
        {
            "ts": 2.0,
            "events": [{"type": "BlockRemoved", "block_hashes": [b"x"], "medium": "GPU"}],
            "data_parallel_rank": 0,
        }
    )
    assert decode_batch(new) == KVEventBatch(2.0, [BlockRemoved([b"x"], "GPU")], 0)
    for bad in (b"\xc1", msgpack.packb([1.0]), msgpack.packb([1.0, [["Nope"]]]), msgpack.packb(["t", []])):
        with pytest.raises(KVEventDecodeError):
            decode_batch(bad)


def test_key_to_hash() -> None:
    assert key_to_hash("00ff") == b"\x00\xff"  # block-key hex: its bytes
    assert key_to_hash("abc") == b"abc"  # odd length: not hex bytes
    assert key_to_hash("k1") == b"k1"
    assert key_to_hash("ABCD") == b"ABCD"  # hex keys are lowercase


def _vllm_types() -> Any:
    """vLLM's KV event structs (as in vllm/distributed/kv_events.py), built with msgspec.defstruct."""
    import msgspec  # vLLM's consumers decode events with it

    opts = {"array_like": True, "omit_defaults": True}
    base = msgspec.defstruct("KVCacheEvent", [], tag=True, **opts)
    hashes = list[bytes | int]
    stored = msgspec.defstruct(
        "BlockStored",
        [("block_hashes", hashes), ("parent_block_hash", bytes | int | None), ("token_ids", list[int]),
         ("block_size", int), ("lora_id", int | None), ("medium", str | None)],
        bases=(base,), tag="BlockStored", **opts,
    )  # fmt: skip
    removed = msgspec.defstruct(
        "BlockRemoved",
        [("block_hashes", hashes), ("medium", str | None)],
        bases=(base,),
        tag="BlockRemoved",
        **opts,
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], bases=(base,), tag="AllBlocksCleared", **opts)
    batch = msgspec.defstruct(
        "KVEventBatch",
        [
            ("ts", float),
            ("events", list[stored | removed | cleared]),
            ("data_parallel_rank", int | None, None),
        ],
        **opts,
    )
    return msgspec, batch


def test_vllm_msgspec_decoder_reads_our_batches() -> None:
    msgspec, batch_type = _vllm_types()
    h = bytes.fromhex("ab" * 16)
    ours = KVEventBatch(3.0, [BlockStored([h], block_size=16), BlockRemoved([h]), AllBlocksCleared()], 0)
    theirs = msgspec.msgpack.Decoder(batch_type).decode(encode_batch(ours))
    assert theirs.data_parallel_rank == 0
    assert [type(e).__name__ for e in theirs.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert theirs.events[0].block_hashes == [h] and theirs.events[0].block_size == 16
    assert decode_batch(msgspec.msgpack.encode(theirs)) == ours


def test_stored_sets_join_and_nothing_else_does() -> None:
    """The store's BlockStored events (sets of blocks: no parent, no token ids) join the one just
    before them; a chain's event, another block size or a removal in between keeps them apart."""
    events: list[KVEvent] = []
    extend_joined(events, [BlockStored([b"a"], block_size=16)])
    extend_joined(events, [BlockStored([b"b"], block_size=16), BlockStored([b"c", b"d"], block_size=16)])
    assert events == [BlockStored([b"a", b"b", b"c", b"d"], block_size=16)]
    extend_joined(
        events,
        [
            BlockRemoved([b"a"]),
            BlockStored([b"e"], block_size=16),
            BlockStored([b"f"], block_size=32),
            BlockStored([b"g"], parent_block_hash=b"f", token_ids=[1] * 32, block_size=32),
            BlockStored([b"h"], block_size=32),
        ],
    )
    extend_joined(events, [BlockStored([b"i"], block_size=32)])
    assert events == [
        BlockStored([b"a", b"b", b"c", b"d"], block_size=16),
        BlockRemoved([b"a"]),  # order kept: a's removal after its store, e after the removal
        BlockStored([b"e"], block_size=16),
        BlockStored([b"f"], block_size=32),
        BlockStored([b"g"], parent_block_hash=b"f", token_ids=[1] * 32, block_size=32),
        BlockStored([b"h", b"i"], block_size=32),
    ]
