"""Regions, descriptors, wire format and the transport registry (no peers needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from yutu.transfer import (
    TRANSPORTS,
    OutOfRangeError,
    Region,
    RegionDescriptor,
    RegionError,
    SegmentDescriptor,
    TransferOp,
    TransferRequest,
    TransportUnavailableError,
    sweep_stale_region_files,
)
from yutu.transfer.tcp_wire import (
    MAX_RANGES,
    RANGE,
    REPLY,
    REQUEST,
    ProtocolError,
    TcpItem,
    WireOp,
    WireStatus,
    advance,
    cut_slices,
    decode_ranges,
    decode_reply_header,
    decode_request_header,
    encode_reply,
    encode_request,
    encode_vector_request,
)
from yutu.transfer.transport import validate_transports

KiB = 1 << 10


def test_region_is_a_shared_file_with_numpy_and_torch_views() -> None:
    region = Region.create("kv", 4096)
    try:
        assert os.path.getsize(region.path) == 4096
        assert region.path.startswith("/dev/shm/")
        arr = region.view_numpy()
        assert arr.dtype == np.uint8 and arr.shape == (4096,) and not arr.any()
        arr[:8] = np.arange(8, dtype=np.uint8)
        assert bytes(region.buffer[:8]) == bytes(range(8))
        t = region.view_torch(torch.float32, (2, 4), offset=64)  # bytes [64, 96)
        t.fill_(1.5)
        assert np.frombuffer(region.buffer[64:96], dtype=np.float32).tolist() == [1.5] * 8
        # Another mapping of the same file (what a same-host peer does) sees the same bytes.
        with open(region.path, "rb") as f:
            assert f.read(8) == bytes(range(8))
        assert region.view_numpy(4000, 96).shape == (96,)
    finally:
        region.close()
    assert not os.path.exists(region.path)
    with pytest.raises(RegionError, match="closed"):
        _ = region.buffer


def test_region_views_survive_close() -> None:
    region = Region.create("kv", 8192)
    arr = region.view_numpy()
    t = region.view_torch(torch.uint8, (8192,))
    arr[0] = 9
    region.close()  # unlinks; pages live on while views exist
    assert arr[0] == 9 and int(t[0]) == 9
    region.close()  # idempotent


def test_region_bounds_and_names() -> None:
    with pytest.raises(RegionError, match="positive"):
        Region.create("kv", 0)
    with pytest.raises(RegionError, match="non-empty"):
        Region.create("", 4096)
    with pytest.raises(RegionError, match="longer than"):
        Region.create("x" * 256, 4096)
    with Region.create("kv", 4096) as region:
        with pytest.raises(OutOfRangeError, match=r"\[4000, 4097\)"):
            region.view_numpy(4000, 97)
        with pytest.raises(OutOfRangeError):
            region.view_numpy(-1, 10)
        with pytest.raises(RegionError, match="multiple"):
            region.view_torch(torch.float32, (2,), offset=2)
        with pytest.raises(OutOfRangeError):
            region.view_torch(torch.float32, (1025,))


def test_sweep_removes_only_files_of_dead_processes() -> None:
    code = "from yutu.transfer import Region; r = Region.create('x', 4096); print(r.path)"
    dead_path = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    # The child exited without close(): its file is left behind, like after SIGKILL.
    assert os.path.exists(dead_path)
    with Region.create("mine", 4096) as mine:
        removed = sweep_stale_region_files()
        assert dead_path in removed
        assert not os.path.exists(dead_path)
        assert os.path.exists(mine.path)


def test_descriptor_json_round_trip() -> None:
    desc = SegmentDescriptor(
        name="node-0",
        incarnation=(1 << 62) + 5,
        pid=123,
        hostname="h",
        host_id="m:b",
        pid_namespace="pid:[1]",
        tcp_host="127.0.0.1",
        tcp_port=4242,
        transports=("shm", "tcp"),
        regions={"pool": RegionDescriptor(1 << 30, "/dev/shm/x", 77)},
    )
    assert SegmentDescriptor.from_json(desc.to_json()) == desc
    assert SegmentDescriptor.from_json(desc.to_json().encode()) == desc
    with pytest.raises(ValueError, match="malformed"):
        SegmentDescriptor.from_json('{"v": 1}')
    with pytest.raises(ValueError, match="version"):
        SegmentDescriptor.from_json('{"v": 99}')


def test_wire_headers_round_trip() -> None:
    raw = encode_request(WireOp.READ, 7, b"pool", 1 << 40, 4096)
    assert len(raw) == REQUEST.size + 4
    assert decode_request_header(raw[: REQUEST.size]) == (WireOp.READ, 4, 7, 1 << 40, 4096)
    reply = encode_reply(WireStatus.OUT_OF_RANGE, 7, 0, "nope")
    assert decode_reply_header(reply[: REPLY.size]) == (WireStatus.OUT_OF_RANGE, 4, 7, 0)
    assert reply[REPLY.size :] == b"nope"
    with pytest.raises(ProtocolError):
        decode_request_header(b"XXXX" + raw[4 : REQUEST.size])
    with pytest.raises(ValueError):
        encode_request(WireOp.READ, 1, b"pool", -1, 10)


def test_vector_requests_round_trip_and_refuse_what_they_cannot_carry() -> None:
    raw = encode_vector_request(WireOp.READV, 9, b"pool", [(0, 4096), (1 << 40, 100), (8192, 1)])
    assert len(raw) == REQUEST.size + 4 + 3 * RANGE.size
    assert decode_request_header(raw[: REQUEST.size]) == (WireOp.READV, 4, 9, 3, 4197)
    body = raw[REQUEST.size + 4 :]
    assert decode_ranges(body, 4197) == [(0, 4096), (1 << 40, 100), (8192, 1)]
    with pytest.raises(ProtocolError, match="add up"):
        decode_ranges(body, 4196)
    with pytest.raises(ValueError, match="2 to"):  # one range is a plain READ
        encode_vector_request(WireOp.READV, 1, b"pool", [(0, 10)])
    with pytest.raises(ValueError, match="2 to"):
        encode_vector_request(WireOp.WRITEV, 1, b"pool", [(0, 10)] * (MAX_RANGES + 1))
    with pytest.raises(ValueError):
        encode_vector_request(WireOp.READV, 1, b"pool", [(0, 10), (-1, 10)])
    too_many = encode_request(WireOp.WRITEV, 1, b"pool", MAX_RANGES + 1, 10)
    with pytest.raises(ProtocolError, match="ranges"):  # a server never reads that many
        decode_request_header(too_many[: REQUEST.size])


def test_items_become_slices_and_vectors() -> None:
    buf = memoryview(bytearray(32 * KiB))
    R, W = WireOp.READ, WireOp.WRITE
    items = (
        [
            TcpItem(R, buf[0:1024], b"a", 0),
            TcpItem(R, buf[1024:2048], b"a", 5000),  # same op, same region: joins the first
            TcpItem(R, buf[2048:3072], b"b", 0),  # another region: a new request
            TcpItem(W, buf[3072:4096], b"b", 0),  # another op: a new request
            TcpItem(W, buf[4096:13312], b"b", 9000),  # 9 KiB, larger than a slice: cut 8 + 1
            TcpItem(W, buf[13312:14336], b"b", 0),  # joins the small last piece of the one before
            TcpItem(W, buf[14336:16384], b"b", 7),  # 2 KiB, not under a quarter slice: alone
        ]
        + [TcpItem(W, buf[16384 + k * 1024 : 17408 + k * 1024], b"b", k) for k in range(9)]
    )
    slices = list(cut_slices(items, 8 * KiB))
    shape = [(s.op, s.region, [(p.item, p.offset, len(p.local)) for p in s.pieces]) for s in slices]
    assert shape == [
        (R, b"a", [(0, 0, 1024), (1, 5000, 1024)]),
        (R, b"b", [(2, 0, 1024)]),
        (W, b"b", [(3, 0, 1024)]),  # the next piece is not small
        (W, b"b", [(4, 9000, 8192)]),
        (W, b"b", [(4, 17192, 1024), (5, 0, 1024)]),
        (W, b"b", [(6, 7, 2048)]),
        (W, b"b", [(7 + k, k, 1024) for k in range(8)]),  # a vector holds at most a slice's bytes
        (W, b"b", [(15, 8, 1024)]),
    ]
    assert [s.nbytes for s in slices] == [2048, 1024, 1024, 8192, 2048, 2048, 8192, 1024]
    assert decode_request_header(slices[1].request(3)[: REQUEST.size])[0] == WireOp.READ
    assert decode_request_header(slices[4].request(3)[: REQUEST.size])[0] == WireOp.WRITEV
    assert [(s.nbytes, s.pieces[0].item) for s in slices[4].singles()] == [(1024, 4), (1024, 5)]
    # one request carries at most MAX_RANGES ranges
    many = [TcpItem(R, buf[k : k + 1], b"a", k) for k in range(MAX_RANGES + 3)]
    assert [len(s.pieces) for s in cut_slices(many, 8 * KiB)] == [MAX_RANGES, 3]


def test_advance_moves_past_whole_views_and_cuts_a_partial_one() -> None:
    views = [memoryview(b"abc"), memoryview(b"de"), memoryview(b"fghi")]
    assert advance(views, 0, 2) == 0 and bytes(views[0]) == b"c"
    assert advance(views, 0, 1) == 1  # exactly the rest of the first
    assert advance(views, 1, 3) == 2 and bytes(views[2]) == b"ghi"
    assert advance(views, 2, 3) == 3  # all done


def test_transport_registry_reserves_rdma_without_offering_it() -> None:
    assert TRANSPORTS["rdma"].offered is False
    assert validate_transports(["tcp", "shm", "tcp"]) == ("tcp", "shm")
    with pytest.raises(TransportUnavailableError, match="rdma.*not available"):
        validate_transports(["rdma"])
    with pytest.raises(TransportUnavailableError, match="unknown transport"):
        validate_transports(["carrier-pigeon"])
    with pytest.raises(TransportUnavailableError):
        validate_transports([])


def test_request_validation() -> None:
    with pytest.raises(ValueError, match="length"):
        TransferRequest(TransferOp.READ, "a", 0, "s", "b", 0, 0)
    with pytest.raises(ValueError, match="offsets"):
        TransferRequest(TransferOp.WRITE, "a", -1, "s", "b", 0, 10)
    with pytest.raises(ValueError, match="op"):
        TransferRequest("read", "a", 0, "s", "b", 0, 10)  # type: ignore[arg-type]
