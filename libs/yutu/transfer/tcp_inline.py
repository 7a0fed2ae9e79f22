"""The TCP client's inline path: small transfers run on the event loop, with no thread hop.

A worker thread costs a small transfer more than its bytes do: ``run_in_executor`` wakes a thread,
the thread takes the GIL back from the loop, and every outcome comes back through
``call_soon_threadsafe`` (a self-pipe write and another wake-up). For a batch of at most
``TcpClient.inline_bytes`` whose peer has an idle pooled connection, ``run_inline`` does the same
exchange as ``TcpClient._run_window`` -- same wire format, same windows, same per-slice outcomes --
on that connection, switched to non-blocking, from the loop itself: ``sendmsg``/``recv_into`` are
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
    WireOp,
    WireStatus,
    decode_reply_header,
    encode_request,
)
from yutu.transfer.transport import COMPLETED, Outcome

if TYPE_CHECKING:
    from yutu.transfer.tcp_client import PeerConnections, TcpItem

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
    poll for up to ``spin_s`` (yielding to the loop between tries), then sleep until readable."""
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


async def send(loop: asyncio.AbstractEventLoop, sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """Send ``parts`` in order from non-blocking ``sock``, one ``sendmsg`` when the buffer takes them."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        try:
            sent = sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            await _wait(loop, sock, True)
            continue
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


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
    window: list[tuple[WireOp, memoryview, bytes, int]],
    ids: list[int],
    done: list[tuple[bool, str, int]],
    spin_s: float = 0.0,
) -> None:
    """One window of ``(op, local, region, offset)`` slices; appends ``(ok, error, nbytes)`` per slice
    to ``done`` as its reply arrives. Raises on a broken connection (the caller fails the rest)."""
    op = window[0][0]
    if op == WireOp.READ:
        await send(loop, sock, [encode_request(op, rid, region, offset, len(local))
                                for rid, (_, local, region, offset) in zip(ids, window, strict=True)])  # fmt: skip
    else:
        parts: list[bytes | memoryview] = []
        for rid, (_, local, region, offset) in zip(ids, window, strict=True):
            parts += [encode_request(op, rid, region, offset, len(local)), local]
        await send(loop, sock, parts)
    reply = bytearray(REPLY.size)
    reply_view = memoryview(reply)
    for rid, (_, local, _, _) in zip(ids, window, strict=True):
        await recv_into(loop, sock, reply_view, spin_s)
        status, msg_len, got_id, length = decode_reply_header(reply)
        if got_id != rid:
            raise ProtocolError(f"reply for request {got_id}, expected {rid}")
        if status != WireStatus.OK:
            msg = bytearray(msg_len)
            await recv_into(loop, sock, memoryview(msg))
            kind = WireStatus(status).name if status in WireStatus._value2member_map_ else str(status)
            done.append((False, f"refused by peer ({kind}): {msg.decode('utf-8', 'replace')}", 0))
            continue
        if length != len(local):
            raise ProtocolError(f"reply announces {length} bytes, expected {len(local)}")
        if op == WireOp.READ:
            await recv_into(loop, sock, local, spin_s)
        done.append((True, "", length))


async def run_inline(
    pool: PeerConnections,
    sock: socket.socket,
    items: list[TcpItem],
    deadline: float,
    on_done: Callable[[int, Outcome], None],
    ids: Iterator[int],
    spin_s: float = 0.0,
) -> None:
    """``items`` (each at most one slice) on ``sock``, from the event loop; the same outcomes as
    ``TcpClient._run_lane`` would report; ``sock`` goes back to ``pool``. ``spin_s``: see
    :func:`recv_into`."""
    loop = asyncio.get_running_loop()
    count, healthy = 0, False
    try:
        sock.setblocking(False)
        async with asyncio.timeout_at(loop.time() + (deadline - time.monotonic())):
            for start, end in windows([it.op for it in items], PIPELINE_WINDOW):
                window = [(it.op, it.local, it.region, it.offset) for it in items[start:end]]
                done: list[tuple[bool, str, int]] = []
                try:
                    await run_window(loop, sock, window, [next(ids) for _ in window], done, spin_s)
                finally:
                    for ok, error, _ in done:
                        on_done(count, COMPLETED if ok else Outcome(TransferStatus.FAILED, error))
                        count += 1
        healthy = True
    except (TransferTimeoutError, TimeoutError):
        for k in range(count, len(items)):
            on_done(k, Outcome(TransferStatus.TIMED_OUT, "deadline passed during the transfer"))
    except (OSError, ProtocolError) as exc:
        pool.drop_idle()
        reason = f"segment {pool.peer.segment!r} failed mid-transfer: {type(exc).__name__}: {exc}"
        failed = Outcome(TransferStatus.FAILED, reason, unreachable=count == 0, peer_failed=True)
        for k in range(count, len(items)):
            on_done(k, failed)
    finally:
        pool.release(sock, healthy)
