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
    REPLY,
    REQUEST,
    ProtocolError,
    WireOp,
    WireStatus,
    decode_reply_header,
    decode_request_header,
    encode_reply,
    encode_request,
)
from yutu.transfer.transport import validate_transports


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
