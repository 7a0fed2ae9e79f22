"""The transport registry, per-request outcomes, and the rule that picks a transport for a peer.

Transports:

- ``shm``: the peer is on this host; map its region file and copy with one memcpy.
- ``tcp``: the peer's data server, over pooled TCP connections. Works everywhere.
- ``rdma``: reserved slot for one-sided RDMA READ/WRITE (ibverbs, as in Mooncake). Not offered by
  this build: asking for it raises ``TransportUnavailableError``. It belongs here so that a
  descriptor listing it, or a config naming it, gets a clear answer rather than a silent fallback.

Choice per request: ``shm`` if both sides allow it, the peer shares our host id and its region file
can be mapped (checked by the SHM transport, which falls back to ``tcp`` when it cannot); else
``tcp`` if both sides allow it; else the request fails with "no common transport".
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from yutu.transfer.errors import TransportUnavailableError
from yutu.transfer.request import TransferStatus
from yutu.transfer.segment import SegmentDescriptor


@dataclass(frozen=True, slots=True)
class TransportInfo:
    name: str
    offered: bool  # implemented and usable in this build
    summary: str


TRANSPORTS: dict[str, TransportInfo] = {
    "shm": TransportInfo("shm", True, "same-host shared memory (/dev/shm), one memcpy per request"),
    "tcp": TransportInfo("tcp", True, "TCP data server, sliced over pooled connections, zero-copy"),
    "rdma": TransportInfo(
        "rdma",
        False,
        "RDMA one-sided READ/WRITE: not implemented in this build (no ibverbs binding)",
    ),
}
DEFAULT_TRANSPORTS: tuple[str, ...] = ("shm", "tcp")


def validate_transports(names: Iterable[str]) -> tuple[str, ...]:
    """Check a user's transport list; return it as a de-duplicated tuple in the given order."""
    out: list[str] = []
    for name in names:
        info = TRANSPORTS.get(name)
        if info is None:
            raise TransportUnavailableError(f"unknown transport {name!r}; choose from {sorted(TRANSPORTS)}")
        if not info.offered:
            raise TransportUnavailableError(
                f"transport {name!r} is not available: {info.summary}; use 'tcp' (and 'shm' on one host)"
            )
        if name not in out:
            out.append(name)
    if not out:
        raise TransportUnavailableError(
            f"at least one transport is needed; choose from {list(DEFAULT_TRANSPORTS)}"
        )
    return tuple(out)


def candidate_transports(local: tuple[str, ...], peer: SegmentDescriptor, host_id: str) -> list[str]:
    """Transports usable towards ``peer`` in order of preference (may be empty)."""
    out = []
    if "shm" in local and "shm" in peer.transports and peer.same_host(host_id):
        out.append("shm")
    if "tcp" in local and "tcp" in peer.transports:
        out.append("tcp")
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a transport reports for one request."""

    status: TransferStatus
    error: str | None = None
    unreachable: bool = False  # failed before any byte moved: the peer could not be reached at all
    peer_failed: bool = False  # the peer's connection broke mid-transfer (reset, EOF, protocol error)


COMPLETED = Outcome(TransferStatus.COMPLETED)


class Progress:
    """Collects per-part outcomes posted from worker threads; reports each request exactly once, on
    the event loop, when all its parts are in (worst outcome wins: a request is COMPLETED only if
    every part is).

    ``post`` is thread-safe and cheap: workers post once per finished slice or window, so a batch's
    early requests are reported while later ones are still moving.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, parts: list[int], on_done: Callable[[int, Outcome], None]
    ) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()  # built on the loop's thread
        self._left = list(parts)  # parts still running, per request
        self._outcomes = [COMPLETED] * len(parts)
        self._on_done = on_done

    def post(self, finished: list[tuple[int, Outcome]]) -> None:
        """From any thread: these (request index, part outcome) pairs are final."""
        if not finished:
            return
        if threading.get_ident() == self._loop_thread:
            self._apply(finished)
        else:
            try:
                self._loop.call_soon_threadsafe(self._apply, finished)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting any more

    def _apply(self, finished: list[tuple[int, Outcome]]) -> None:
        for index, outcome in finished:
            if outcome.status is not TransferStatus.COMPLETED and self._outcomes[index] is COMPLETED:
                self._outcomes[index] = outcome
            self._left[index] -= 1
            assert self._left[index] >= 0, "a part was reported twice"
            if self._left[index] == 0:
                self._on_done(index, self._outcomes[index])
