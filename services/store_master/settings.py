"""The store master's settings, built once from flags in ``main`` and passed down."""

from __future__ import annotations

from dataclasses import dataclass

from yutu.config import ServiceSettings

from services.store_master.state import StatePolicy


@dataclass(frozen=True)
class MasterSettings(ServiceSettings):
    port: int  # RPC (ZeroMQ ROUTER); 0: any free port
    admin_port: int  # admin REST; 0: any free port
    kv_events: bool  # publish KV events at all
    kv_events_port: int  # ZeroMQ PUB; 0: any free port
    kv_events_replay_port: int | None  # ZeroMQ ROUTER for replays; None: no replay
    kv_events_topic: str
    data_parallel_rank: int  # rank written into every event batch
    policy: StatePolicy
    sweep_interval_s: float  # how often liveness, put timeouts, retired space and watermark are checked
    persist: bool  # keep metadata in Redis (and recover it at start)
    stream_port: int | None = 0  # the same RPC over a plain TCP stream (yutu.rpc.stream); 0: any; None: off
    spin_us: int = 0  # the stream server polls this long after a reply while calls come back to back

    def __post_init__(self) -> None:
        if self.spin_us < 0:
            raise ValueError(f"--spin-us must be >= 0, got {self.spin_us}")
        if self.sweep_interval_s <= 0:
            raise ValueError(f"--sweep-interval must be positive, got {self.sweep_interval_s}")
        for name in ("port", "admin_port", "kv_events_port", "stream_port"):
            value = getattr(self, name)
            if value is None:
                continue
            if not 0 <= value <= 65535:
                raise ValueError(f"--{name.replace('_', '-')} must be a port number (0 for any), got {value}")
