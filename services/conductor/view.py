"""The conductor's global view: live instances, their load, the KV blocks each one and the store hold.

Fed by three streams and read once per placement as a plain :class:`yutu.sched.ClusterView`::

    registry (every poll)      -> which prefill and decode instances exist, and their endpoints
    load reports (PUB/SUB)     -> queue, running batch, free blocks, measured step/prefill/transfer times
    KV events (vLLM shape)     -> the block keys each instance's prefix cache holds, and the store's

Placements the conductor made but no report reflects yet are kept as *pending* per instance, so two
requests placed within one report interval see each other: a prefill instance's queue and free
blocks count them, a decode instance lists them as incoming (the sched package's contract).

- On a prefill instance a pending entry is dropped once a report names it among its queued
  prompts (the instance then counts it itself), or when its first token comes. A report made
  before the request reached the engine -- a busy front end or worker can take longer than any
  fixed lag -- does not name it, so it keeps counting.
- On a decode instance it stays until a report *shows* it: load reports name no requests, but a
  sequence's ``context_tokens + remaining_max_tokens`` is ``prompt_len + max_tokens`` for all its
  life (the engine counts the prefill's token as generated), its *signature*. A report shows a
  handed-over request when it lists more running sequences of that signature than the fewest any
  report listed since the handoff (the others of that signature can only have left since; several
  pending requests of one signature are shown oldest first). Until its first token comes it cannot
  be running there; its forecast arrival is then its predicted prefill end, or now if that passed.
- A request the gateway says ended (``Finished``) is dropped everywhere at once: one that the first
  token finished, or that ended between two reports, is never shown.
- Bounds, so a lost request cannot hold capacity: ``pending_ttl_s`` after the placement until its
  first token, ``handoff_ttl_s`` after the first token (in case its ``Finished`` was lost).

All times are the conductor's monotonic clock, passed in; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yutu.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from yutu.protocol.load import LoadReport
from yutu.registry import ServiceRecord
from yutu.sched import (
    ClusterView,
    DecodeView,
    IncomingDecode,
    Placement,
    PrefillView,
    QueuedPrefill,
    RequestView,
    RunningDecode,
)

ROLES = ("prefill", "decode")
STORE = "store"  # the KV-event source name of the store master


@dataclass
class Pending:
    """A placement not yet visible in its instance's load reports."""

    request_id: str
    prompt_len: int
    reused_tokens: int
    max_tokens: int
    blocks: int  # KV blocks it will take there
    placed_at: float
    ready_at: float  # predicted end of its prefill (when a decode instance gets it)
    handed_at: float | None = None  # its first token came: the decode instance has it from now on
    local: bool = False  # on a decode instance that prefills it itself (no prefill instance named)
    priority: int = 0  # its request's (the engines serve a lower value first)
    floor: int | None = None  # on a decode: fewest running sequences of its signature seen since then

    @property
    def signature(self) -> int:
        """``context_tokens + remaining_max_tokens`` of its row in a decode's report, all its life."""
        return self.prompt_len + self.max_tokens


@dataclass
class Instance:
    instance_id: str
    role: str
    record: ServiceRecord
    report: LoadReport | None = None
    report_at: float | None = None
    cached: set[str] = field(default_factory=set)  # block keys of its prefix cache (from KV events)
    pending: list[Pending] = field(default_factory=list)

    @property
    def broken(self) -> str | None:
        value = self.record.meta.get("broken")
        return str(value) if value else None

    @property
    def max_batch(self) -> int:
        return max(1, int(self.record.meta.get("max_num_seqs", 64)))

    @property
    def chunk_tokens(self) -> int | None:
        """Its prefill chunk (``max_num_batched_tokens`` in its record), None when it does not say."""
        value = self.record.meta.get("max_num_batched_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def endpoint(self, name: str) -> str | None:
        return self.record.endpoints.get(name)


class GlobalView:
    def __init__(
        self,
        block_size: int,
        report_stale_s: float,
        pending_ttl_s: float = 30.0,
        handoff_ttl_s: float = 10.0,
    ) -> None:
        self.block_size = block_size
        self.report_stale_s = report_stale_s
        self.pending_ttl_s = pending_ttl_s
        self.handoff_ttl_s = handoff_ttl_s
        self.instances: dict[str, Instance] = {}
        self.store_keys: set[str] = set()
        self.bytes_per_block = 0  # from the workers' records (all must agree)

    # -- registry ---------------------------------------------------------------------------------

    def update_records(self, records: list[ServiceRecord]) -> tuple[list[str], list[str]]:
        """The registry's current prefill and decode records; returns (joined, left) instance ids."""
        seen = {r.instance_id: r for r in records if r.kind in ROLES}
        left = [i for i in self.instances if i not in seen]
        for instance_id in left:
            del self.instances[instance_id]
        joined = []
        for instance_id, record in seen.items():
            current = self.instances.get(instance_id)
            if current is None or current.record.pid != record.pid or current.role != record.kind:
                self.instances[instance_id] = Instance(instance_id, record.kind, record)
                joined.append(instance_id)
            else:
                current.record = record
            block_bytes = record.meta.get("block_bytes")
            if isinstance(block_bytes, int) and block_bytes > 0:
                self.bytes_per_block = block_bytes
        return joined, left

    # -- streams ----------------------------------------------------------------------------------

    def on_report(self, report: LoadReport, now: float) -> bool:
        """Take a load report; False if its instance is unknown (not yet listed, or gone)."""
        instance = self.instances.get(report.instance_id)
        if instance is None:
            return False
        if (
            instance.report is not None
            and report.seq <= instance.report.seq
            and report.time <= instance.report.time
        ):
            return True  # an old report arriving late
        instance.report = report
        instance.report_at = now
        if instance.role == "prefill":
            if instance.pending:
                named = {q[3] for q in report.queued if len(q) > 3 and isinstance(q[3], str)}
                instance.pending = [p for p in instance.pending if p.request_id not in named]
        else:
            instance.pending = _unshown(instance.pending, report)
        return True

    def on_kv_events(self, source: str, batch: KVEventBatch) -> None:
        keys = self.store_keys if source == STORE else self._cached(source)
        if keys is None:
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                keys.update(_hex(h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                keys.difference_update(_hex(h) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                keys.clear()

    def reset_keys(self, source: str) -> None:
        keys = self.store_keys if source == STORE else self._cached(source)
        if keys is not None:
            keys.clear()

    def _cached(self, instance_id: str) -> set[str] | None:
        instance = self.instances.get(instance_id)
        return None if instance is None else instance.cached

    # -- placements -------------------------------------------------------------------------------

    def note_placement(self, placement: Placement, request: RequestView, now: float) -> None:
        """Count a placement on its instances until their reports do."""
        blocks = -(-(request.prompt_len + request.max_tokens) // self.block_size)
        reused = (
            placement.plan.fetch_end if placement.plan.fetch_blocks else placement.plan.local_blocks
        ) * self.block_size
        for other in self.instances.values():  # a placement again (its prefill failed) replaces it
            if other.pending:
                other.pending = [p for p in other.pending if p.request_id != request.request_id]
        for instance_id in {placement.prefill_id, placement.decode_id} - {None}:
            instance = self.instances.get(str(instance_id))
            if instance is not None:
                instance.pending.append(
                    Pending(
                        request.request_id,
                        request.prompt_len,
                        min(reused, request.prompt_len - 1),
                        request.max_tokens,
                        blocks,
                        now,
                        placement.ready_at_s,
                        local=placement.prefill_id is None,
                        priority=request.priority,
                    )  # fmt: skip
                )

    def prefill_done(self, request_id: str, now: float) -> None:
        """A request's first token came (the gateway said so): its prefill no longer queues anywhere,
        and its decode instance has it (a later report shows it running: module docstring)."""
        for instance in self.instances.values():
            if not instance.pending:
                continue
            if instance.role == "prefill":
                instance.pending = [p for p in instance.pending if p.request_id != request_id]
                continue
            for p in instance.pending:
                if p.request_id == request_id and p.handed_at is None:
                    p.handed_at = now
                    if instance.report is not None:
                        p.floor = _count(instance.report, p.signature)

    def request_done(self, request_id: str) -> None:
        """A request ended (the gateway said so): it no longer counts anywhere."""
        for instance in self.instances.values():
            if instance.pending:
                instance.pending = [p for p in instance.pending if p.request_id != request_id]

    def live(self, role: str, now: float, exclude: frozenset[str] = frozenset()) -> list[Instance]:
        """Instances of ``role`` that may take work: listed, reporting, not broken, not excluded."""
        out = []
        for instance in self.instances.values():
            if instance.role != role or instance.instance_id in exclude or instance.broken:
                continue
            if (
                instance.report is None
                or instance.report_at is None
                or now - instance.report_at > self.report_stale_s
            ):
                continue
            out.append(instance)
        return sorted(out, key=lambda i: i.instance_id)

    def snapshot(self, now: float, exclude: frozenset[str] = frozenset()) -> ClusterView:
        """The view a policy places one request on."""
        self._expire(now)
        prefills = tuple(self._prefill_view(i) for i in self.live("prefill", now, exclude))
        decodes = tuple(self._decode_view(i, now) for i in self.live("decode", now, exclude))
        return ClusterView(prefills, decodes, self.store_keys, max(1, self.bytes_per_block), self.block_size)

    def _expire(self, now: float) -> None:
        for instance in self.instances.values():
            if instance.pending:
                instance.pending = [p for p in instance.pending if not self._expired(p, now)]

    def _expired(self, p: Pending, now: float) -> bool:
        if p.handed_at is None:
            return now - p.placed_at >= self.pending_ttl_s
        return now - p.handed_at >= self.handoff_ttl_s

    def _prefill_view(self, instance: Instance) -> PrefillView:
        report = instance.report
        assert report is not None
        queue = [_queued(q) for q in report.queued if q and q[0] > 0]
        queue += [_waiting(p) for p in instance.pending]
        free = report.free_blocks - sum(p.blocks for p in instance.pending)
        return PrefillView(instance.instance_id, instance.cached, max(0, free), tuple(queue))

    def _decode_view(self, instance: Instance, now: float) -> DecodeView:
        report = instance.report
        assert report is not None
        running = tuple(RunningDecode(max(1, d[0]), max(0, d[1])) for d in report.decoding if d)
        incoming = tuple(
            IncomingDecode(_arrival(p, now), p.prompt_len, p.max_tokens) for p in instance.pending
        )
        return DecodeView(
            instance.instance_id,
            max(0, report.free_blocks),
            instance.max_batch,
            running,
            incoming,
            instance.cached,
            chunk_tokens=instance.chunk_tokens,
            prefills=_local_prefills(instance.pending, report),
        )


def _queued(q: list[Any]) -> QueuedPrefill:
    """A load report's ``[prompt_len, reused, computed, request_id, priority, admitted]`` row, clamped
    into a valid entry."""
    reused = min(q[1], q[0])
    priority = q[4] if len(q) > 4 and isinstance(q[4], int) and not isinstance(q[4], bool) else 0
    admitted = len(q) > 5 and q[5] is True
    return QueuedPrefill(q[0], reused, max(0, min(q[2], q[0] - reused)), priority, admitted)


def _waiting(p: Pending) -> QueuedPrefill:
    """A placement its instance has not reported yet: a prompt waiting there."""
    return QueuedPrefill(p.prompt_len, p.reused_tokens, priority=p.priority)


def _local_prefills(pending: list[Pending], report: LoadReport) -> tuple[QueuedPrefill, ...]:
    """The prompts a decode instance prefills itself: the local placements whose first token has not
    come, with the progress its report shows for those it names (a decode's report also lists the
    handed-over requests whose KV is loading; those are not its prefills)."""
    if not any(p.local for p in pending):
        return ()
    rows = {q[3]: q for q in report.queued if len(q) > 3 and isinstance(q[3], str) and q[0] > 0}
    out = []
    for p in pending:
        if p.local and p.handed_at is None:
            row = rows.get(p.request_id)
            out.append(_waiting(p) if row is None else _queued(row))
    return tuple(out)


def _arrival(p: Pending, now: float) -> float:
    """When ``p`` joins its decode's batch: at its first token once that came; before, at its predicted
    prefill end, or now when that has passed (a prefill running late has not handed anything over)."""
    return p.handed_at if p.handed_at is not None else max(p.ready_at, now)


def _count(report: LoadReport, signature: int) -> int:
    """Running sequences of ``report`` with ``signature`` (``Pending.signature``)."""
    return sum(1 for d in report.decoding if len(d) >= 2 and d[0] + d[1] == signature)


def _unshown(pending: list[Pending], report: LoadReport) -> list[Pending]:
    """The decode instance's pending requests ``report`` does not show running (module docstring)."""
    groups: dict[int, list[Pending]] = {}
    for p in pending:
        if p.handed_at is not None:
            groups.setdefault(p.signature, []).append(p)
    shown: set[int] = set()
    for signature, group in groups.items():
        count = _count(report, signature)
        known = [p.floor for p in group if p.floor is not None]
        if not known:  # handed over before any report: this one sets the floor, conservatively
            for p in group:
                p.floor = count
            continue
        new = max(0, count - min(known))
        group.sort(key=lambda p: (p.handed_at, p.placed_at))
        for p in group[:new]:
            shown.add(id(p))
        for p in group[new:]:
            p.floor = count if new else min(count, p.floor if p.floor is not None else count)
    return [p for p in pending if id(p) not in shown]


def _hex(block_hash: bytes | int) -> str:
    if isinstance(block_hash, bytes):
        return block_hash.hex()
    return format(block_hash, "032x")
