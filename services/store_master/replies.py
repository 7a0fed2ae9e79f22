"""Replica descriptors as the master sends them: a replica record plus its segment's region and host.

A replica's descriptor is built once and kept on the record (``Replica.descriptor``): the fields
it is made of never change for a replica, except its state (WRITING, then COMPLETE at put_end),
which is compared on every use. A batch get then sends kept descriptors without building any.

A kept descriptor is a plain tuple of the descriptor's fields, its state and medium as their
values: what msgpack writes for a ``ReplicaDescriptor`` anyway (an array; the enums as strings),
so the bytes on the wire are the same and readers get the NamedTuple and its enums back from
``ReplicaDescriptor.from_wire``. CPython's garbage collector stops tracking an exact tuple of
strings, ints and None; a NamedTuple, or a tuple holding enum members, stays tracked for as long as
its replica lives (see services.store_master.objects). :func:`describe` builds the NamedTuple.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from yutu.store.types import ReplicaDescriptor

from services.store_master.objects import Replica
from services.store_master.segments import SegmentTable


def describe(segments: SegmentTable, replica: Replica) -> ReplicaDescriptor:
    """The descriptor of ``replica`` (region and host "" when its segment is gone), built afresh."""
    segment = segments.get(replica.segment)
    region, host_id = ("", "") if segment is None else (segment.region, segment.host_id)
    return ReplicaDescriptor(
        replica.segment, region, replica.offset, replica.length, replica.state, host_id, replica.medium
    )


def descriptors(segments: SegmentTable, replicas: Iterable[Replica]) -> list[ReplicaDescriptor]:
    """:func:`describe` of each replica as it goes on the wire, from the descriptor kept on it while
    it is current (its enums as their values: see above)."""
    out = []
    for r in replicas:
        d = r.descriptor
        if d is None or d[4] != r.state:  # [4]: the state
            segment = segments.get(r.segment)
            region, host_id = ("", "") if segment is None else (segment.region, segment.host_id)
            wire = (r.segment, region, r.offset, r.length, r.state.value, host_id, r.medium.value)
            d = r.descriptor = cast(ReplicaDescriptor, wire)  # a plain tuple: see above
        out.append(d)
    return out
