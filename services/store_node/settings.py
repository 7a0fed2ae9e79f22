"""A store node's settings, built once from flags in ``main`` and passed down."""

from __future__ import annotations

from dataclasses import dataclass

from yutu.config import ServiceSettings
from yutu.transfer.tcp_wire import check_congestion

REGION_NAME = "dram"  # the registered region a node contributes


@dataclass(frozen=True)
class NodeSettings(ServiceSettings):
    segment_name: str  # transfer-engine segment name (unique in the deployment)
    segment_size: int  # bytes of DRAM contributed
    master: str | None  # explicit master RPC endpoint; None: find it in the registry
    transfer_port: int  # TCP data server port; 0: any free port
    transports: tuple[str, ...]  # transports served, e.g. ("shm", "tcp")
    tcp_connections: int
    admin_port: int
    tcp_congestion: str | None  # the data connections' TCP congestion control; None: the host's
    heartbeat_interval_s: float
    disk_dir: str | None = None  # disk tier directory; None: no disk tier
    disk_capacity: int = 0
    prefault: bool = True  # fault the segment's pages in at start (Region.populate)

    def __post_init__(self) -> None:
        check_congestion(self.tcp_congestion)
        if self.segment_size <= 0:
            raise ValueError(f"--segment-size must be positive, got {self.segment_size}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"--heartbeat-interval must be positive, got {self.heartbeat_interval_s}")
        if self.disk_dir is not None and self.disk_capacity <= 0:
            raise ValueError("--disk-capacity must be positive when --disk-dir is given")
