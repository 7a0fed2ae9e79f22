"""The KV event wire shape (vLLM's msgspec array_like tagged structs), pinned to exact msgpack."""

from __future__ import annotations

import msgpack
import pytest
from yutu.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
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
