"""The TCP client's inline path: small transfers run on the event loop, with no thread hop.

A worker thread costs a small transfer more than its bytes do: ``run_in_executor`` wakes a thread,
the thread takes the GIL back from the loop, and every outcome comes back through
``call_soon_threadsafe`` (a self-pipe write and another wake-up). For a batch of at most
``TcpClient.inline_bytes`` whose peer has an idle pooled connection, ``run_inline`` does the same
exchange as ``TcpClient._run_lane`` -- the same requests (``cut_slices``), same windows, same
per-item outcomes -- on that connection, switched to non-blocking, from the loop itself: ``sendmsg``/``recv_into`` are
tried first and the loop waits for readiness only when the socket would block, so a reply that is
already there costs one syscall. A reply not there yet is polled for, awake, for up to ``spin_s``
before the loop sleeps on the socket (``yutu.busypoll``: on a VM, being woken costs more than a
small transfer's bytes).

The thread path (``TcpClient._run_lane``) stays the reference: it serves everything larger, every
batch that needs a new connection (``connect`` blocks), and is tested to move the same bytes with
the same outcomes as this one (tests/transfer/test_transfer_inline.py).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from yutu.busypoll import awake_until, poll_once
from yutu.transfer.errors import TransferTimeoutError
from yutu.transfer.request import TransferStatus
from yutu.transfer.tcp_wire import (
    REPLY,
    ProtocolError,
    Slice,
    TcpItem,
    WireOp,
    WireStatus,
    advance,
    cut_slices,
    decode_reply_header,
    refusal,
)
from yutu.transfer.transport import COMPLETED, Outcome

if TYPE_CHECKING:
    from yutu.transfer.tcp_client import PeerConnections

PIPELINE_WINDOW = 32  # slices in flight per connection (both paths)


async def _wait(loop: asyncio.AbstractEventLoop, sock: socket.socket, writable: bool) -> None:
    """Until ``sock`` is readable (or writable)."""
    fut = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    if writable:
        loop.add_writer(fd, ready)
    else:
        loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        if writable:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def recv_into(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview, spin_s: float = 0.0
) -> None:
    """Fill ``view`` from non-blocking ``sock``; ``ConnectionError`` on EOF. While nothing is there,
    poll for up to ``spin_s`` (yielding to the loop between tries), then sleep until readable. The
    budget counts silence, not the whole call: it starts again whenever bytes arrive, so a payload
    that streams in never puts the loop to sleep between two of its pieces."""
    pos, total = 0, len(view)
    until = awake_until(spin_s)
    while pos < total:
        try:
            n = sock.recv_into(view[pos:])
        except (BlockingIOError, InterruptedError):
            if not (spin_s and await poll_once(until)):
                await _wait(loop, sock, False)
            continue
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {pos} of {total} bytes")
        pos += n
        if spin_s:
            until = awake_until(spin_s)


async def send(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, parts: list[bytes | memoryview], spin_s: float = 0.0
) -> None:
    """Send ``parts`` in order from non-blocking ``sock``, one ``sendmsg`` when the buffer takes them.
    While the buffer is full, poll for up to ``spin_s`` of no progress (as :func:`recv_into`) before
    sleeping until writable."""
    views, k = [memoryview(p).cast("B") for p in parts], 0
    until = awake_until(spin_s)
    while k < len(views):
        try:
            sent = sock.sendmsg(views[k:])
        except (BlockingIOError, InterruptedError):
            if not (spin_s and await poll_once(until)):
                await _wait(loop, sock, True)
            continue
        k = advance(views, k, sent)
        if spin_s:
            until = awake_until(spin_s)


def windows(ops: list[WireOp], limit: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` runs of one op, at most ``limit`` long: READ and WRITE never share a window."""
    start = 0
    while start < len(ops):
        end = start + 1
        while end < len(ops) and end - start < limit and ops[end] == ops[start]:
            end += 1
        yield start, end
        start = end


async def run_window(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    window: list[Slice],
    ids: list[int],
    done: list[tuple[int, Outcome]],
    again: list[Slice],
    spin_s: float = 0.0,
) -> None:
    """One window of requests of one op; appends ``(item, outcome)`` per piece to ``done`` as its
    reply arrives, and the pieces of a refused vector request to ``again``, each a request of its
    own. Raises on a broken connection (the caller fails the rest)."""
    op = window[0].op
    if op == WireOp.READ:
        await send(loop, sock, [s.request(rid) for rid, s in zip(ids, window, strict=True)], spin_s)
    else:
        parts: list[bytes | memoryview] = []
        for rid, s in zip(ids, window, strict=True):
            parts += [s.request(rid), *(p.local for p in s.pieces)]
        await send(loop, sock, parts, spin_s)
    reply = bytearray(REPLY.size)
    reply_view = memoryview(reply)
    for rid, s in zip(ids, window, strict=True):
        await recv_into(loop, sock, reply_view, spin_s)
        status, msg_len, got_id, length = decode_reply_header(reply)
        if got_id != rid:
            raise ProtocolError(f"reply for request {got_id}, expected {rid}")
        if status != WireStatus.OK:
            msg = bytearray(msg_len)
            await recv_into(loop, sock, memoryview(msg))
            if len(s.pieces) > 1:
                again += s.singles()
                continue
            error = refusal(status, msg.decode("utf-8", "replace"))
            done.append((s.pieces[0].item, Outcome(TransferStatus.FAILED, error)))
            continue
        if length != s.nbytes:
            raise ProtocolError(f"reply announces {length} bytes, expected {s.nbytes}")
        if op == WireOp.READ:
            for p in s.pieces:
                await recv_into(loop, sock, p.local, spin_s)
        done += [(p.item, COMPLETED) for p in s.pieces]


async def run_inline(
    pool: PeerConnections,
    sock: socket.socket,
    items: list[TcpItem],
    step: int,
    deadline: float,
    on_done: Callable[[int, Outcome], None],
    ids: Iterator[int],
    spin_s: float = 0.0,
) -> None:
    """``items`` (``step`` bytes at most in all, so each is one piece) on ``sock``, from the event
    loop, as requests of up to ``step`` bytes; the same outcomes as ``TcpClient._run_lane`` would
    report; ``sock`` goes back to ``pool``. ``spin_s``: see :func:`recv_into`."""
    loop = asyncio.get_running_loop()
    reported, heard, healthy = [False] * len(items), False, False

    def report(done: list[tuple[int, Outcome]]) -> None:
        for item, outcome in done:
            on_done(item, outcome)
            reported[item] = True

    try:
        sock.setblocking(False)
        async with asyncio.timeout_at(loop.time() + (deadline - time.monotonic())):
            todo = list(cut_slices(items, step))
            while todo:
                again: list[Slice] = []
                for start, end in windows([s.op for s in todo], PIPELINE_WINDOW):
                    done: list[tuple[int, Outcome]] = []
                    try:
                        ids_ = [next(ids) for _ in range(start, end)]
                        await run_window(loop, sock, todo[start:end], ids_, done, again, spin_s)
                    finally:
                        heard = heard or bool(done or again)
                        report(done)
                todo = again
        healthy = True
    except (TransferTimeoutError, TimeoutError):
        report([(k, Outcome(TransferStatus.TIMED_OUT, "deadline passed during the transfer"))
                for k in range(len(items)) if not reported[k]])  # fmt: skip
    except (OSError, ProtocolError) as exc:
        pool.drop_idle()
        reason = f"segment {pool.peer.segment!r} failed mid-transfer: {type(exc).__name__}: {exc}"
        failed = Outcome(TransferStatus.FAILED, reason, unreachable=not heard, peer_failed=True)
        report([(k, failed) for k in range(len(items)) if not reported[k]])
    finally:
        pool.release(sock, healthy)
