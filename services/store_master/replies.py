"""Replica descriptors as the master sends them: a replica record plus its segment's region and host."""

from __future__ import annotations

from collections.abc import Iterable

from yutu.store.types import ReplicaDescriptor

from services.store_master.objects import Replica
from services.store_master.segments import SegmentTable


def describe(segments: SegmentTable, replica: Replica) -> ReplicaDescriptor:
    """The descriptor of ``replica`` (region and host "" when its segment is gone)."""
    segment = segments.get(replica.segment)
    region, host_id = ("", "") if segment is None else (segment.region, segment.host_id)
    return ReplicaDescriptor(
        replica.segment, region, replica.offset, replica.length, replica.state, host_id, replica.medium
    )


class Describer:
    """:func:`describe` for many replicas at once, looking each segment up once (a batch get's
    replicas mostly share a few segments). One per reply: segments do not change meanwhile."""

    def __init__(self, segments: SegmentTable) -> None:
        self.segments = segments
        self._where: dict[str, tuple[str, str]] = {}  # segment -> (region, host_id)

    def all(self, replicas: Iterable[Replica]) -> list[ReplicaDescriptor]:
        out = []
        where = self._where
        for r in replicas:
            seg = where.get(r.segment)
            if seg is None:
                segment = self.segments.get(r.segment)
                seg = where[r.segment] = ("", "") if segment is None else (segment.region, segment.host_id)
            out.append(ReplicaDescriptor(r.segment, seg[0], r.offset, r.length, r.state, seg[1], r.medium))
        return out
