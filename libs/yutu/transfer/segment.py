"""Segment descriptors: what one engine publishes so that peers can reach its regions.

A segment is one process's named set of registered regions plus the endpoints that serve them.
The descriptor is a plain frozen data object, encoded as JSON for the segment directory (Redis).
``incarnation`` is a random id drawn per engine start: a peer that restarts under the same name
gets a new one, so stale cached descriptors and pooled connections are told apart from fresh ones.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

DESCRIPTOR_VERSION = 1


@dataclass(frozen=True, slots=True)
class RegionDescriptor:
    """Where a peer finds one region: its size, shared-memory file path and the file's inode."""

    size: int
    path: str
    inode: int


@dataclass(frozen=True, slots=True)
class SegmentDescriptor:
    """The published view of one engine's segment."""

    name: str  # segment name, unique in the directory
    incarnation: int  # random per engine start (63 bits)
    pid: int  # owner process id
    hostname: str  # for humans and logs
    host_id: str  # equal on two processes iff they share a host (and so /dev/shm)
    pid_namespace: str  # pids are only comparable inside one pid namespace
    tcp_host: str  # the data server's advertised address
    tcp_port: int
    transports: tuple[str, ...]  # transports this segment serves, e.g. ("shm", "tcp")
    regions: dict[str, RegionDescriptor] = field(default_factory=dict)

    def to_json(self) -> str:
        body: dict[str, Any] = {
            "v": DESCRIPTOR_VERSION,
            "name": self.name,
            "incarnation": self.incarnation,
            "pid": self.pid,
            "hostname": self.hostname,
            "host_id": self.host_id,
            "pid_namespace": self.pid_namespace,
            "tcp": [self.tcp_host, self.tcp_port],
            "transports": list(self.transports),
            "regions": {k: [r.size, r.path, r.inode] for k, r in self.regions.items()},
        }
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> SegmentDescriptor:
        """Decode a descriptor; raises ``ValueError`` on a malformed or foreign-version payload."""
        try:
            body = json.loads(raw)
            if body.get("v") != DESCRIPTOR_VERSION:
                raise ValueError(f"descriptor version {body.get('v')!r} != {DESCRIPTOR_VERSION}")
            tcp_host, tcp_port = body["tcp"]
            return cls(
                name=str(body["name"]),
                incarnation=int(body["incarnation"]),
                pid=int(body["pid"]),
                hostname=str(body["hostname"]),
                host_id=str(body["host_id"]),
                pid_namespace=str(body["pid_namespace"]),
                tcp_host=str(tcp_host),
                tcp_port=int(tcp_port),
                transports=tuple(str(t) for t in body["transports"]),
                regions={
                    str(k): RegionDescriptor(int(size), str(path), int(inode))
                    for k, (size, path, inode) in body["regions"].items()
                },
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed segment descriptor: {exc}") from exc

    def same_host(self, host_id: str) -> bool:
        return self.host_id == host_id

    def same_pid_namespace(self, host_id: str, pid_namespace: str) -> bool:
        return self.host_id == host_id and self.pid_namespace == pid_namespace


def _read_first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


@lru_cache(maxsize=1)
def local_host_id() -> str:
    """An id equal for all processes on one booted host: machine-id + boot id, else the hostname.

    Containers with their own machine-id (or none) and their own hostname get distinct ids, which
    is right: they do not share ``/dev/shm`` unless told to, and then the inode check in the SHM
    transport still guards against mapping a different file.
    """
    machine = _read_first_line("/etc/machine-id")
    boot = _read_first_line("/proc/sys/kernel/random/boot_id")
    if machine and boot:
        return f"{machine}:{boot}"
    return f"host:{socket.gethostname()}"


@lru_cache(maxsize=1)
def local_pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return f"pidns:{socket.gethostname()}"
