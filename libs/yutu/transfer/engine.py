"""The transfer engine: one process's segment, and batched asynchronous READ/WRITE to any segment.

Shape after Mooncake's Transfer Engine: a process registers memory regions into its segment, the
segment descriptor is published in the segment directory, and any engine can then READ from or
WRITE into those regions by (segment, region, offset), in batches whose requests complete and fail
independently. The engine is a thin coordinator: the data server serves peers, the TCP client and
the SHM transport move bytes; the engine resolves names, checks bounds, picks a transport, and
records one ``TransferResult`` per request.

    engine = TransferEngine("prefill-0", SegmentDirectory(redis))
    async with engine:
        kv = engine.register_region("kv", 64 << 20)
        await engine.publish()
        results = await engine.transfer([TransferRequest(TransferOp.READ, "kv", 0, "store-1", "pool", 0, 4096)])

Threading: the event loop only resolves and dispatches; copies and socket I/O run in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from yutu.busypoll import SPIN_US
from yutu.config import advertised
from yutu.supervise import cancel_and_wait
from yutu.transfer.directory import SegmentDirectory
from yutu.transfer.errors import RegionError, SegmentNotFoundError, TransferError
from yutu.transfer.region import Region, check_range, validate_region_name
from yutu.transfer.request import TransferBatch, TransferOp, TransferRequest, TransferResult, TransferStatus
from yutu.transfer.segment import RegionDescriptor, SegmentDescriptor, local_host_id, local_pid_namespace
from yutu.transfer.shm import ShmItem, ShmTransport
from yutu.transfer.tcp_client import INLINE_BYTES, PeerAddress, TcpClient, TcpItem
from yutu.transfer.tcp_server import DataServer
from yutu.transfer.tcp_wire import DEFAULT_CONGESTION, WireOp, check_congestion
from yutu.transfer.transport import (
    COMPLETED,
    DEFAULT_TRANSPORTS,
    Outcome,
    candidate_transports,
    validate_transports,
)

log = logging.getLogger(__name__)

WAIT_GRACE_S = 1.0  # past a batch's deadline, unfinished requests are TIMED_OUT by the engine itself


def _loop_time_of(monotonic_deadline: float) -> float:
    """A ``time.monotonic()`` deadline on the running loop's clock."""
    return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())


class TransferEngine:
    """Owns one segment (regions + data server + directory entry) and runs transfer batches."""

    def __init__(
        self,
        segment_name: str,
        directory: SegmentDirectory,
        host: str = "127.0.0.1",
        port: int = 0,
        tcp_connections: int = 4,
        default_timeout_s: float = 30.0,
        *,
        transports: Sequence[str] = DEFAULT_TRANSPORTS,
        advertise_host: str | None = None,
        tcp_slice_bytes: int = 2 << 20,
        shm_dir: str | None = None,
        tcp_inline_bytes: int = INLINE_BYTES,
        tcp_spin_us: int = SPIN_US,
        tcp_congestion: str | None = DEFAULT_CONGESTION,
    ) -> None:
        """``host``/``port``: where the TCP data server listens (port 0: any free port).
        ``tcp_connections``: pooled connections per peer. ``default_timeout_s``: batch deadline when
        ``submit`` gets none. ``transports`` limits what this engine uses and offers (e.g.
        ``("tcp",)`` to force TCP; "rdma" raises ``TransportUnavailableError``). ``advertise_host``:
        the address peers dial when ``host`` is a wildcard. ``tcp_slice_bytes``: TCP transfers are
        cut into slices of this size, spread over the pooled connections. ``shm_dir``: where region
        files are created (default ``/dev/shm``). ``tcp_inline_bytes``: TCP batches up to this size
        run on the event loop instead of worker threads when a pooled connection is idle (0: never;
        see ``yutu.transfer.tcp_inline``); ``tcp_spin_us``: how long such a batch waits for a reply
        awake before sleeping (``yutu.busypoll``; 0: sleep at once). ``tcp_congestion``: the TCP
        congestion control of its data connections, both ways (default Reno, see
        ``tcp_wire.DEFAULT_CONGESTION``; None: the host's default); ``ValueError`` if this process may
        not use it."""
        if not isinstance(segment_name, str) or not segment_name or len(segment_name.encode()) > 255:
            raise ValueError(f"segment_name must be a non-empty str of <= 255 bytes, got {segment_name!r}")
        if default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be > 0, got {default_timeout_s}")
        check_congestion(tcp_congestion)
        self.tcp_congestion = tcp_congestion
        self.segment_name = segment_name
        self.directory = directory
        self.transports = validate_transports(transports)
        self.default_timeout_s = default_timeout_s
        self._host, self._port = host, port
        self._advertise = advertised(host, advertise_host)  # the rule every service follows
        self._shm_dir = shm_dir
        self._incarnation = secrets.randbits(63)
        self._regions: dict[str, Region] = {}
        self._tcp = TcpClient(
            tcp_connections,
            tcp_slice_bytes,
            inline_bytes=min(tcp_inline_bytes, tcp_slice_bytes),
            spin_s=tcp_spin_us / 1e6,
            congestion=tcp_congestion,
        )
        self._shm = ShmTransport()
        self._server: DataServer | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._batches: set[asyncio.Task[None]] = set()
        self._started = False
        self._closed = False

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the data server and publish the segment. Raises ``SegmentConflictError`` if a live
        engine already publishes this segment name."""
        if self._started:
            raise RuntimeError("TransferEngine.start() called twice")
        self._started = True
        if "tcp" in self.transports:
            self._server = DataServer(
                self._host, self._port, self.segment_name, self._incarnation, self._regions.get,
                self.tcp_congestion,
            )  # fmt: skip
            self._server.start()
        try:
            await self.directory.claim(self.descriptor())
        except BaseException:
            if self._server is not None:
                self._server.close()
            raise
        self._keepalive = asyncio.create_task(self._keep_alive(), name=f"yutu-segment-{self.segment_name}")

    async def close(self) -> None:
        """Withdraw the segment, stop serving, fail in-flight batches, unlink all regions (always,
        even when a step before raises or the close is cancelled)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._stop_serving()
        finally:
            for region in self._regions.values():
                region.close()
            self._regions.clear()

    async def _stop_serving(self) -> None:
        if self._keepalive is not None:
            await cancel_and_wait([self._keepalive], "transfer engine")
        if self._started:
            try:
                await self.directory.withdraw(self.descriptor())
            except Exception as exc:  # Redis down: the entry expires by itself
                log.warning("could not withdraw segment %r: %s", self.segment_name, exc)
        if self._server is not None:
            self._server.close()
        self._tcp.close()
        self._shm.close()
        for task in list(self._batches):
            task.cancel()
        if self._batches:
            await asyncio.gather(*self._batches, return_exceptions=True)

    async def __aenter__(self) -> TransferEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ----------------------------------------------------------------- segment

    @property
    def regions(self) -> Mapping[str, Region]:
        """Read-only view of the registered regions by name."""
        return MappingProxyType(self._regions)

    @property
    def endpoint(self) -> tuple[str, int] | None:
        """The data server's advertised (host, port), or None before start / without TCP."""
        return None if self._server is None else (self._advertise, self._server.port)

    def register_region(self, name: str, size: int) -> Region:
        """Create and register a zero-filled shared-memory region. Call ``await publish()`` after
        registering so peers see it. Raises ``RegionError`` on a duplicate name or bad size."""
        self._check_open()
        validate_region_name(name)
        if name in self._regions:
            raise RegionError(f"region {name!r} is already registered in segment {self.segment_name!r}")
        region = Region.create(name, size, self._shm_dir)
        self._regions[name] = region
        return region

    def unregister_region(self, name: str) -> None:
        """Stop serving region ``name`` and unlink its memory (views held by the caller stay valid).
        Call ``await publish()`` afterwards."""
        region = self._regions.pop(name, None)
        if region is None:
            raise RegionError(f"region {name!r} is not registered in segment {self.segment_name!r}")
        region.close()

    def descriptor(self) -> SegmentDescriptor:
        """This segment's descriptor as peers will see it."""
        return SegmentDescriptor(
            name=self.segment_name,
            incarnation=self._incarnation,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            host_id=local_host_id(),
            pid_namespace=local_pid_namespace(),
            tcp_host=self._advertise,
            tcp_port=0 if self._server is None else self._server.port,
            transports=self.transports,
            regions={n: RegionDescriptor(r.size, r.path, r.inode) for n, r in self._regions.items()},
        )

    async def publish(self) -> None:
        """Refresh the directory entry (after registering or unregistering regions)."""
        self._check_open()
        if self._started:
            await self.directory.publish(self.descriptor())

    async def _keep_alive(self) -> None:
        period = self.directory.ttl_s / 3
        while True:
            await asyncio.sleep(period)
            self._shm.prune()
            try:
                await self.directory.publish(self.descriptor())
            except Exception as exc:  # keep trying: a Redis blip must not kill the segment
                log.warning("segment %r keepalive failed: %s", self.segment_name, exc)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"engine of segment {self.segment_name!r} is closed")

    # ----------------------------------------------------------------- transfers

    async def submit(
        self, requests: Sequence[TransferRequest], timeout_s: float | None = None
    ) -> TransferBatch:
        """Start a batch; every request gets its own result. ``timeout_s`` (default
        ``default_timeout_s``) bounds the whole batch: requests unfinished by then are TIMED_OUT."""
        batch = self._new_batch(requests, timeout_s)
        if requests:
            task = asyncio.create_task(self._run_batch(batch))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)
        return batch

    async def transfer(
        self, requests: Sequence[TransferRequest], timeout_s: float | None = None
    ) -> list[TransferResult]:
        """``submit`` then ``wait``, with the batch run in the caller's task (no task hop). Requests
        still unfinished shortly after the deadline are TIMED_OUT, as with ``wait``."""
        batch = self._new_batch(requests, timeout_s)
        if requests:
            try:
                async with asyncio.timeout_at(_loop_time_of(batch.deadline + WAIT_GRACE_S)):
                    await self._run_batch(batch)
            except TimeoutError:
                pass  # _run_batch marked what was unfinished TIMED_OUT
        return await batch.wait()

    def _new_batch(self, requests: Sequence[TransferRequest], timeout_s: float | None) -> TransferBatch:
        self._check_open()
        if not self._started:
            raise TransferError("call await engine.start() before submitting transfers")
        for req in requests:
            if not isinstance(req, TransferRequest):
                raise TypeError(f"expected TransferRequest, got {type(req).__name__}")
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout}")
        return TransferBatch(requests, time.monotonic() + timeout)

    async def _run_batch(self, batch: TransferBatch) -> None:
        by_segment: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(batch.requests):
            by_segment[req.remote_segment].append(i)
        try:
            if len(by_segment) == 1:  # the common case: skip gather's extra tasks
                [(seg, idx)] = by_segment.items()
                await self._run_segment(batch, seg, idx, True)
            else:
                await asyncio.gather(
                    *(self._run_segment(batch, s, idx, True) for s, idx in by_segment.items())
                )
        except asyncio.CancelledError:
            if time.monotonic() > batch.deadline:  # transfer()'s backstop timer
                result = TransferResult(TransferStatus.TIMED_OUT, "deadline passed")
            else:
                result = TransferResult(TransferStatus.FAILED, "engine closed during the transfer")
            for i in range(len(batch.requests)):
                batch._finish(i, result)
            raise
        except Exception as exc:  # a bug, but never leave a waiter hanging
            log.exception("transfer batch crashed")
            for i in range(len(batch.requests)):
                batch._finish(i, TransferResult(TransferStatus.FAILED, f"internal error: {exc!r}"))

    async def _run_segment(self, batch: TransferBatch, segment: str, indices: list[int], retry: bool) -> None:
        """Run ``batch.requests[indices]``, all addressed to ``segment``."""
        peer = await self._lookup(batch, segment, indices, fresh=False)
        if peer is not None and any(batch.requests[i].remote_region not in peer.regions for i in indices):
            peer = await self._lookup(batch, segment, indices, fresh=True)  # maybe registered since cached
        if peer is None:
            return
        shm_idx: list[int] = []
        shm_items: list[ShmItem] = []
        tcp_idx: list[int] = []
        tcp_items: list[TcpItem] = []
        candidates = candidate_transports(self.transports, peer, local_host_id())
        # (local region, remote region) -> (transport, remote descriptor, local region, its whole
        # uint8 array): routed once
        routes: dict[tuple[str, str], tuple[str, RegionDescriptor, Region, np.ndarray]] = {}
        requests = batch.requests
        for i in indices:
            req = requests[i]
            try:
                route = routes.get((req.local_region, req.remote_region))
                if route is None:
                    transport, remote, local = self._route(
                        req.local_region, req.remote_region, peer, candidates
                    )
                    route = routes[(req.local_region, req.remote_region)] = (
                        transport, remote, local, local.view_numpy(),
                    )  # fmt: skip
                transport, remote, local, whole = route
                check_range(req.remote_region, remote.size, req.remote_offset, req.length)
                check_range(req.local_region, local.size, req.local_offset, req.length)
                if transport == "shm":
                    view = whole[req.local_offset : req.local_offset + req.length]  # (length,)
                    shm_items.append(ShmItem(req.op, view, req.remote_region, remote, req.remote_offset))
                    shm_idx.append(i)
                else:
                    mv = local.buffer[req.local_offset : req.local_offset + req.length]
                    op = WireOp.READ if req.op is TransferOp.READ else WireOp.WRITE
                    tcp_items.append(TcpItem(op, mv, req.remote_region.encode("utf-8"), req.remote_offset))
                    tcp_idx.append(i)
            except TransferError as exc:
                batch._finish(i, TransferResult(TransferStatus.FAILED, str(exc)))
        unreachable: list[int] = []
        reasons: list[str] = []
        via: set[str] = set()  # transports that found the peer unreachable

        def done(transport: str, idx: list[int]) -> Callable[[int, Outcome], None]:
            ok = TransferResult(TransferStatus.COMPLETED, None, transport)

            def on_done(k: int, outcome: Outcome) -> None:
                if outcome is COMPLETED:
                    batch._finish(idx[k], ok)
                    return
                if outcome.peer_failed:
                    self.directory.invalidate(segment)
                if outcome.unreachable:
                    unreachable.append(idx[k])
                    reasons.append(outcome.error or "")
                    via.add(transport)
                else:
                    batch._finish(idx[k], TransferResult(outcome.status, outcome.error, transport))

            return on_done

        jobs: list[Coroutine[Any, Any, None]] = []
        if shm_items:
            jobs.append(self._shm.execute(peer, shm_items, batch.deadline, done("shm", shm_idx)))
        if tcp_items:
            address = PeerAddress(peer.tcp_host, peer.tcp_port, peer.name, peer.incarnation)
            jobs.append(self._tcp.execute(address, tcp_items, batch.deadline, done("tcp", tcp_idx)))
        if len(jobs) == 1:
            await jobs[0]
        elif jobs:
            await asyncio.gather(*jobs)
        if unreachable:
            await self._after_unreachable(batch, segment, peer, sorted(unreachable), retry, reasons[0], via)

    async def _after_unreachable(
        self,
        batch: TransferBatch,
        segment: str,
        old: SegmentDescriptor,
        indices: list[int],
        retry: bool,
        reason: str,
        via: set[str],
    ) -> None:
        """The peer could not be reached: re-read the directory. Gone -> "segment not found";
        restarted (new incarnation) -> retry once; its shared-memory file gone but TCP allowed ->
        retry once over TCP; otherwise the peer is dead or stuck."""
        self.directory.invalidate(segment)
        self._tcp.forget(PeerAddress(old.tcp_host, old.tcp_port, old.name, old.incarnation))
        self._shm.forget(old)
        fresh = await self._lookup(batch, segment, indices, fresh=True)
        if fresh is None:
            return
        tcp_possible = "tcp" in candidate_transports(self.transports, fresh, local_host_id())
        if retry and (fresh.incarnation != old.incarnation or (via == {"shm"} and tcp_possible)):
            await self._run_segment(batch, segment, indices, False)
            return
        self.directory.invalidate(segment)  # its entry is stale: do not trust it next time either
        self._fail(
            batch, indices, f"segment {segment!r} (pid {old.pid} on {old.hostname}) is unreachable: {reason}"
        )

    async def _lookup(
        self, batch: TransferBatch, segment: str, indices: list[int], fresh: bool
    ) -> SegmentDescriptor | None:
        """The directory entry of ``segment``; None once ``indices`` are failed with the reason."""
        try:
            return await self.directory.lookup(segment, fresh=fresh)
        except SegmentNotFoundError as exc:
            self._fail(batch, indices, str(exc))
        except Exception as exc:
            self._fail(batch, indices, f"segment directory lookup of {segment!r} failed: {exc}")
        return None

    def _route(
        self, local_name: str, remote_name: str, peer: SegmentDescriptor, candidates: list[str]
    ) -> tuple[str, RegionDescriptor, Region]:
        """Resolve both regions and choose the transport among ``candidates`` (those usable towards
        ``peer``); raise ``TransferError`` to fail the request. Ranges are checked per request by
        the caller."""
        local = self._regions.get(local_name)
        if local is None:
            raise RegionError(f"unknown local region {local_name!r}; register it first")
        remote = peer.regions.get(remote_name)
        if remote is None:
            raise RegionError(f"unknown region {remote_name!r} in segment {peer.name!r}")
        if "shm" in candidates and self._shm.usable(remote):  # a dict hit once mapped
            return "shm", remote, local
        if "tcp" in candidates:
            return "tcp", remote, local
        raise TransferError(
            f"no common transport with segment {peer.name!r}: we use {list(self.transports)}, "
            f"it offers {list(peer.transports)}"
            + (" and its shared-memory file cannot be mapped" if "shm" in candidates else "")
        )

    @staticmethod
    def _fail(batch: TransferBatch, indices: list[int], error: str) -> None:
        for i in indices:
            batch._finish(i, TransferResult(TransferStatus.FAILED, error))
