"""The TCP data server: serves READ and WRITE of this engine's registered regions to peers.

Threads, not asyncio: one accept thread and one thread per connection, each with blocking sockets.
Payload moves straight between the socket and the region's mapping (``sendall`` of a memoryview
slice, ``recv_into`` a memoryview slice); the GIL is released inside those calls, so the event loop
of the owning process stays responsive.

Every request is bounds-checked against the live region table before any byte of a region is
touched: unknown region or ``offset + length > size`` gets an error reply and the region is left
unchanged (the payload of a refused WRITE is read into a scratch buffer and dropped, so the stream
stays in step; a refused WRITE longer than ``DRAIN_LIMIT`` closes the connection instead). A vector
request (READV, WRITEV: several ranges of one region) is checked range by range first and served
or refused as a whole; its payload moves with one ``sendmsg`` / ``recvmsg_into`` over the ranges
as far as the socket takes it.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from yutu.transfer.errors import RegionError
from yutu.transfer.region import Region
from yutu.transfer.tcp_wire import (
    DEFAULT_CONGESTION,
    RANGE,
    REQUEST,
    ProtocolError,
    WireOp,
    WireStatus,
    decode_ranges,
    decode_request_header,
    discard,
    encode_reply,
    recv_exact,
    recv_exact_into,
    recv_into_parts,
    send_parts,
    tune_socket,
)

log = logging.getLogger(__name__)

DRAIN_LIMIT = 64 << 20
SCRATCH_BYTES = 1 << 20


class DataServer:
    """Accepts peer connections and serves region reads and writes until ``close()``."""

    def __init__(
        self,
        host: str,
        port: int,
        segment_name: str,
        incarnation: int,
        resolve_region: Callable[[str], Region | None],
        congestion: str | None = DEFAULT_CONGESTION,
    ) -> None:
        """``congestion``: the TCP congestion control of the connections it accepts (None: the host's
        default; ``tcp_wire.DEFAULT_CONGESTION``)."""
        self._congestion = congestion
        self._segment = segment_name.encode("utf-8")
        self._incarnation = incarnation
        self._resolve = resolve_region
        self._listener = socket.create_server((host, port), backlog=128)
        self.host, self.port = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closing = False
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"yutu-data-accept-{segment_name}", daemon=True
        )

    def start(self) -> None:
        self._accept_thread.start()

    def close(self) -> None:
        """Stop accepting, and cut every open connection (in-flight requests fail on the peer)."""
        with self._lock:
            self._closing = True
            conns = list(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept_thread.join(timeout=2.0)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="yutu-data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            tune_socket(conn, self._congestion)
            self._serve_requests(conn)
        except (OSError, ProtocolError) as exc:  # ConnectionError is an OSError
            log.debug("data connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_requests(self, conn: socket.socket) -> None:
        header = bytearray(REQUEST.size)
        header_view = memoryview(header)
        greeted = False
        while True:
            first = conn.recv_into(header_view)
            if first == 0:
                return  # clean close between requests
            recv_exact_into(conn, header_view[first:])
            op, name_len, rid, offset, length = decode_request_header(header)
            name = recv_exact(conn, name_len)
            if op == WireOp.HELLO:
                greeted = name == self._segment and offset == self._incarnation
                status = WireStatus.OK if greeted else WireStatus.WRONG_SEGMENT
                msg = "" if greeted else "this data server belongs to another segment or incarnation"
                conn.sendall(encode_reply(status, rid, 0, msg))
                if not greeted:
                    return
                continue
            if not greeted or op not in (WireOp.READ, WireOp.WRITE, WireOp.READV, WireOp.WRITEV):
                conn.sendall(encode_reply(WireStatus.BAD_REQUEST, rid, 0, f"unexpected op {op} here"))
                return
            if op in (WireOp.READV, WireOp.WRITEV):
                ranges = decode_ranges(recv_exact(conn, offset * RANGE.size), length)
            else:
                ranges = [(offset, length)]
            views, status, msg = self._locate(name, ranges)
            if op in (WireOp.READ, WireOp.READV):
                if views is None:
                    conn.sendall(encode_reply(status, rid, 0, msg))
                else:
                    send_parts(conn, [encode_reply(WireStatus.OK, rid, length), *views])
                continue
            if views is None:
                if length > DRAIN_LIMIT:
                    conn.sendall(encode_reply(status, rid, 0, msg + "; connection closed"))
                    return
                discard(conn, length, memoryview(bytearray(min(length, SCRATCH_BYTES))))
                conn.sendall(encode_reply(status, rid, 0, msg))
                continue
            recv_into_parts(conn, views)
            conn.sendall(encode_reply(WireStatus.OK, rid, length))

    def _locate(
        self, name: bytes, ranges: list[tuple[int, int]]
    ) -> tuple[list[memoryview] | None, WireStatus, str]:
        """The region slices of a request's ranges (one for READ and WRITE), or ``None`` with the
        refusal status and reason (for a vector request, naming the first range refused)."""
        try:
            region_name = name.decode("utf-8")
        except UnicodeDecodeError:
            return None, WireStatus.UNKNOWN_REGION, "region name is not valid UTF-8"
        region = self._resolve(region_name)
        if region is None:
            return None, WireStatus.UNKNOWN_REGION, f"unknown region {region_name!r}"
        for k, (offset, length) in enumerate(ranges):
            if length == 0 or offset + length > region.size:
                which = f"range {k} of {len(ranges)}: " if len(ranges) > 1 else ""
                return (
                    None,
                    WireStatus.OUT_OF_RANGE,
                    f"{which}range [{offset}, {offset + length}) is outside region {region_name!r} of "
                    f"{region.size} bytes",
                )
        try:
            buffer = region.buffer
        except RegionError:
            return None, WireStatus.UNKNOWN_REGION, f"region {region_name!r} was unregistered"
        return [buffer[offset : offset + length] for offset, length in ranges], WireStatus.OK, ""
