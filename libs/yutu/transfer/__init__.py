"""yutu.transfer — the transfer engine: segments, batched async READ/WRITE, SHM and TCP transports.

Public API::

    directory = SegmentDirectory(redis)                     # redis.asyncio client
    engine = TransferEngine("node-0", directory)            # optional transports=("tcp",)
    async with engine:
        region = engine.register_region("pool", 64 << 20)   # shared memory, numpy/torch views
        await engine.publish()
        results = await engine.transfer([TransferRequest(TransferOp.READ, "pool", 0, "node-1", "pool", 0, 4096)])
"""

from yutu.transfer.directory import SegmentDirectory
from yutu.transfer.engine import TransferEngine
from yutu.transfer.errors import (
    OutOfRangeError,
    PeerError,
    PeerUnreachableError,
    RegionError,
    RemoteRefusedError,
    SegmentConflictError,
    SegmentNotFoundError,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
)
from yutu.transfer.region import Region, sweep_stale_region_files
from yutu.transfer.request import TransferBatch, TransferOp, TransferRequest, TransferResult, TransferStatus
from yutu.transfer.segment import RegionDescriptor, SegmentDescriptor
from yutu.transfer.transport import TRANSPORTS

__all__ = [
    "TRANSPORTS",
    "OutOfRangeError",
    "PeerError",
    "PeerUnreachableError",
    "Region",
    "RegionDescriptor",
    "RegionError",
    "RemoteRefusedError",
    "SegmentConflictError",
    "SegmentDescriptor",
    "SegmentDirectory",
    "SegmentNotFoundError",
    "TransferBatch",
    "TransferEngine",
    "TransferError",
    "TransferOp",
    "TransferRequest",
    "TransferResult",
    "TransferStatus",
    "TransferTimeoutError",
    "TransportUnavailableError",
    "sweep_stale_region_files",
]
