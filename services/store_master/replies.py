"""Replica descriptors as the master sends them: a replica record plus its segment's region and host.

A replica's descriptor is built once and kept on the record (``Replica.descriptor``): the fields
it is made of never change for a replica, except its state (WRITING, then COMPLETE at put_end),
which is compared on every use. A batch get then sends kept descriptors without building any.
"""

from __future__ import annotations

from collections.abc import Iterable

from yutu.store.types import ReplicaDescriptor

from services.store_master.objects import Replica
from services.store_master.segments import SegmentTable

_new = tuple.__new__  # a NamedTuple built from a tuple in C, without its generated __new__


def describe(segments: SegmentTable, replica: Replica) -> ReplicaDescriptor:
    """The descriptor of ``replica`` (region and host "" when its segment is gone), built afresh."""
    segment = segments.get(replica.segment)
    region, host_id = ("", "") if segment is None else (segment.region, segment.host_id)
    return ReplicaDescriptor(
        replica.segment, region, replica.offset, replica.length, replica.state, host_id, replica.medium
    )


def descriptors(segments: SegmentTable, replicas: Iterable[Replica]) -> list[ReplicaDescriptor]:
    """:func:`describe` of each replica, from the descriptor kept on it while it is current."""
    out = []
    for r in replicas:
        d = r.descriptor
        if d is None or d[4] is not r.state:  # [4]: the state
            segment = segments.get(r.segment)
            region, host_id = ("", "") if segment is None else (segment.region, segment.host_id)
            d = r.descriptor = _new(
                ReplicaDescriptor, (r.segment, region, r.offset, r.length, r.state, host_id, r.medium)
            )
        out.append(d)
    return out
