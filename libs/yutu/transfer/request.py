"""Transfer requests, their per-request results, and the batch handle returned by ``submit``.

READ copies ``remote[remote_offset : remote_offset + length]`` into
``local[local_offset : local_offset + length]``; WRITE copies the other way. A batch completes
request by request: one failing request never changes the status (or the bytes) of another.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any


class TransferOp(enum.IntEnum):
    READ = 1  # remote -> local
    WRITE = 2  # local -> remote


class TransferStatus(enum.Enum):
    PENDING = "pending"  # only seen through TransferBatch.poll(); wait() never returns it
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True, slots=True, init=False)
class TransferRequest:
    """One contiguous copy between a local region and a region of a (possibly remote) segment."""

    op: TransferOp
    local_region: str
    local_offset: int
    remote_segment: str
    remote_region: str
    remote_offset: int
    length: int

    def __init__(
        self,
        op: TransferOp,
        local_region: str,
        local_offset: int,
        remote_segment: str,
        remote_region: str,
        remote_offset: int,
        length: int,
    ) -> None:
        # What the frozen dataclass __init__ would do, at half the cost (one request per KV block):
        # it sets each field through object.__setattr__, this sets the slots directly.
        s = _REQUEST_SLOTS
        s[0](self, op)
        s[1](self, local_region)
        s[2](self, local_offset)
        s[3](self, remote_segment)
        s[4](self, remote_region)
        s[5](self, remote_offset)
        s[6](self, length)
        self._check()

    def _check(self) -> None:
        if not isinstance(self.op, TransferOp):
            raise ValueError(f"op must be TransferOp.READ or TransferOp.WRITE, got {self.op!r}")
        if not (type(self.local_offset) is type(self.remote_offset) is type(self.length) is int):
            for field_name in ("local_offset", "remote_offset", "length"):  # the slow path: say which
                value = getattr(self, field_name)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"{field_name} must be an int, got {value!r}")
        if self.length <= 0:
            raise ValueError(f"length must be positive, got {self.length}")
        if self.local_offset < 0 or self.remote_offset < 0:
            raise ValueError(
                f"offsets must be >= 0, got local {self.local_offset}, remote {self.remote_offset}"
            )


_REQUEST_SLOTS: tuple[Callable[[TransferRequest, Any], None], ...] = tuple(
    getattr(TransferRequest, f.name).__set__ for f in fields(TransferRequest)
)


@dataclass(frozen=True, slots=True)
class TransferResult:
    """Outcome of one request. ``error`` says why when the status is not COMPLETED."""

    status: TransferStatus
    error: str | None = None
    transport: str | None = None  # "shm" or "tcp" once a transport was chosen

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.COMPLETED


_PENDING = TransferResult(TransferStatus.PENDING)


class TransferBatch:
    """Handle of a submitted batch; results are filled in by the engine as requests finish.

    Only the engine calls ``_finish``; users call ``wait``, ``poll`` and ``done``.
    """

    def __init__(self, requests: Sequence[TransferRequest], deadline: float) -> None:
        self.requests: tuple[TransferRequest, ...] = tuple(requests)
        self.deadline = deadline  # time.monotonic() after which pending requests are TIMED_OUT
        self._results: list[TransferResult] = [_PENDING] * len(self.requests)
        self._pending = len(self.requests)
        self._done = asyncio.Event()
        if self._pending == 0:
            self._done.set()

    def _finish(self, index: int, result: TransferResult) -> None:
        """Record the result of request ``index``; the first result recorded wins."""
        assert result.status is not TransferStatus.PENDING
        if self._results[index].status is not TransferStatus.PENDING:
            return
        self._results[index] = result
        self._pending -= 1
        if self._pending == 0:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def poll(self) -> list[TransferStatus]:
        """Current status of every request, without waiting (PENDING for those in flight)."""
        return [r.status for r in self._results]

    async def wait(self) -> list[TransferResult]:
        """Wait until every request has finished or the batch deadline passed.

        Requests still unfinished shortly after the deadline are reported TIMED_OUT (the transports
        enforce the deadline themselves; this is the backstop).
        """
        if not self._done.is_set():
            grace_s = 1.0
            remaining = self.deadline - time.monotonic() + grace_s
            try:
                await asyncio.wait_for(self._done.wait(), timeout=max(remaining, 0.0))
            except TimeoutError:
                for i, r in enumerate(self._results):
                    if r.status is TransferStatus.PENDING:
                        self._finish(i, TransferResult(TransferStatus.TIMED_OUT, "deadline passed"))
        return list(self._results)
