"""Wire format of the TCP data plane, and exact-length socket helpers.

Request  (client -> server), 32 bytes then ``name_len`` bytes of UTF-8 region name::

    magic "YUTU" | version u8 | op u8 | name_len u16 | request_id u64 | offset u64 | length u64

    op READ : server replies, then sends ``length`` payload bytes if the status is OK
    op WRITE: client sends ``length`` payload bytes right after the name; server replies after
              storing them (or after discarding them, when refused)
    op HELLO: first message on a connection; name = segment name, offset = incarnation. The server
              answers OK only if it is that very segment, so a reused port never receives writes
              meant for a dead peer.
    op READV, WRITEV: several ranges of one region in one request (a batch of small objects moves
              as a few large messages, not one exchange per object): ``offset`` is the number of
              ranges (2 to ``MAX_RANGES``), ``length`` their total, and the name is followed by
              that many ``offset u64 | length u64`` pairs. The payload is the ranges' bytes back to
              back, both ways. The server refuses the whole request if any range is out of bounds
              (a refused WRITEV's payload is read and dropped, as for WRITE).

Reply    (server -> client), 24 bytes then ``msg_len`` bytes of UTF-8 error text::

    magic "YUTU" | version u8 | status u8 | msg_len u16 | request_id u64 | length u64

All integers are big-endian. Offsets and lengths are unsigned on the wire: the client refuses
negative values before encoding, and the server checks ``offset + length <= region size``.
"""

from __future__ import annotations

import enum
import socket
import struct
from collections import deque
from dataclasses import dataclass

MAGIC = b"YUTU"
VERSION = 1
REQUEST = struct.Struct("!4sBBHQQQ")
REPLY = struct.Struct("!4sBBHQQ")
RANGE = struct.Struct("!QQ")
MAX_NAME_BYTES = 1024
MAX_RANGES = 256
MAX_U64 = (1 << 64) - 1


class WireOp(enum.IntEnum):
    READ = 1
    WRITE = 2
    HELLO = 3
    READV = 4
    WRITEV = 5


VECTOR_OF = {WireOp.READ: WireOp.READV, WireOp.WRITE: WireOp.WRITEV}

# The congestion control of every data-plane socket, by default: Reno, which every process may set
# (the kernel never restricts it) and which sends a burst as fast as the window lets it. The host's
# default may pace instead: with BBR (the default of some distributions and clouds) the kernel spaces a
# KV burst out with timers, and a burst after a pause may wait for them -- single 1 MiB reads over
# loopback between two processes, 150 us apart, on the 2-core benchmark VM: p50 248 / 242 us, p99
# 1,141 / 1,175 us under BBR; 188 / 191 us, p99 321 / 390 us under Reno (CUBIC alike). Nothing
# changes for 64 KiB reads (p50 50-66 us either way). See docs/performance.md ("A single 1 MiB get's
# tail"). ``None`` keeps the host's default (``--tcp-congestion system``).
DEFAULT_CONGESTION: str | None = "reno"


class WireStatus(enum.IntEnum):
    OK = 0
    UNKNOWN_REGION = 1
    OUT_OF_RANGE = 2
    BAD_REQUEST = 3
    WRONG_SEGMENT = 4


class ProtocolError(Exception):
    """The byte stream does not follow this format (bad magic or version, oversized name)."""


def encode_request(op: WireOp, request_id: int, name: bytes, offset: int, length: int) -> bytes:
    if not (0 <= offset <= MAX_U64 and 0 <= length <= MAX_U64 and len(name) <= MAX_NAME_BYTES):
        raise ValueError(f"cannot encode offset={offset} length={length} name of {len(name)} bytes")
    return REQUEST.pack(MAGIC, VERSION, op, len(name), request_id, offset, length) + name


def encode_vector_request(op: WireOp, request_id: int, name: bytes, ranges: list[tuple[int, int]]) -> bytes:
    """A READV or WRITEV request for ``ranges`` = [(offset, length), ...] of region ``name``."""
    if not 2 <= len(ranges) <= MAX_RANGES:
        raise ValueError(f"a vector request carries 2 to {MAX_RANGES} ranges, not {len(ranges)}")
    head = encode_request(op, request_id, name, len(ranges), sum(length for _, length in ranges))
    try:
        return head + b"".join(RANGE.pack(offset, length) for offset, length in ranges)
    except struct.error as exc:
        raise ValueError(f"cannot encode ranges {ranges}: {exc}") from exc


def decode_ranges(body: bytes, total: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` pairs of a vector request's ``body``; ``ProtocolError`` unless their
    lengths add up to the header's ``total``."""
    ranges = [RANGE.unpack_from(body, k) for k in range(0, len(body), RANGE.size)]
    if sum(length for _, length in ranges) != total:
        raise ProtocolError(f"vector request's ranges do not add up to its length {total}")
    return ranges


# -- requests: what a batch's items become on the wire -------------------------------------


@dataclass(slots=True)
class TcpItem:
    """One request as the TCP transport sees it: ``local`` is exactly the bytes to move."""

    op: WireOp  # READ or WRITE
    local: memoryview  # local region slice, len == transfer length
    region: bytes  # remote region name, UTF-8
    offset: int  # remote offset


@dataclass(slots=True)
class Piece:
    """One range of one item: ``local`` to or from the peer's region at ``offset``."""

    item: int  # index into the items list
    local: memoryview
    offset: int


@dataclass(slots=True)
class Slice:
    """What one request moves: one piece (READ/WRITE), or several of one region (READV/WRITEV)."""

    op: WireOp  # READ or WRITE
    region: bytes
    pieces: list[Piece]
    nbytes: int

    def request(self, rid: int) -> bytes:
        if len(self.pieces) == 1:
            p = self.pieces[0]
            return encode_request(self.op, rid, self.region, p.offset, self.nbytes)
        ranges = [(p.offset, len(p.local)) for p in self.pieces]
        return encode_vector_request(VECTOR_OF[self.op], rid, self.region, ranges)

    def singles(self) -> list[Slice]:
        """Each piece as a request of its own (a refused vector request's ranges are asked again
        one by one, so a refusal fails only the item it is about)."""
        return [Slice(self.op, self.region, [p], len(p.local)) for p in self.pieces]


def cut_slices(items: list[TcpItem], step: int) -> deque[Slice]:
    """``items`` as requests of at most ``step`` bytes each: an item larger than ``step`` is cut into
    pieces, and consecutive small pieces (under ``step // 4``) of one op and region join one vector
    request while they fit in ``step`` -- a batch of many small items costs a few exchanges, not one
    per item. Larger pieces go alone: their exchange costs little next to their bytes, and a batch
    of fewer, larger requests spreads less evenly over the lanes (32 x 1 MiB gets as 16 vectors of
    two were no faster: 4-11% slower in three pairs, within noise in two alternating runs)."""
    small = step // 4
    slices: deque[Slice] = deque()
    for index, it in enumerate(items):
        for start in range(0, len(it.local), step):  # [start, start + step) of this item
            piece = Piece(index, it.local[start : start + step], it.offset + start)
            last = slices[-1] if slices else None
            if (
                last is not None
                and len(piece.local) < small
                and len(last.pieces[0].local) < small
                and last.op == it.op
                and last.region == it.region
                and last.nbytes + len(piece.local) <= step
                and len(last.pieces) < MAX_RANGES
            ):
                last.pieces.append(piece)
                last.nbytes += len(piece.local)
            else:
                slices.append(Slice(it.op, it.region, [piece], len(piece.local)))
    return slices


def encode_reply(status: WireStatus, request_id: int, length: int, message: str = "") -> bytes:
    msg = message.encode("utf-8")[:4096]
    return REPLY.pack(MAGIC, VERSION, status, len(msg), request_id, length) + msg


def decode_request_header(header: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int]:
    """Return ``(op, name_len, request_id, offset, length)`` or raise ``ProtocolError``."""
    magic, version, op, name_len, request_id, offset, length = REQUEST.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad request header magic={magic!r} version={version}")
    if name_len > MAX_NAME_BYTES:
        raise ProtocolError(f"region name of {name_len} bytes exceeds {MAX_NAME_BYTES}")
    if op in (WireOp.READV, WireOp.WRITEV) and not 2 <= offset <= MAX_RANGES:
        raise ProtocolError(f"vector request of {offset} ranges (2 to {MAX_RANGES})")
    return op, name_len, request_id, offset, length


def decode_reply_header(header: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """Return ``(status, msg_len, request_id, length)`` or raise ``ProtocolError``."""
    magic, version, status, msg_len, request_id, length = REPLY.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad reply header magic={magic!r} version={version}")
    return status, msg_len, request_id, length


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from ``sock``; raise ``ConnectionError`` on EOF."""
    pos = 0
    total = len(view)
    while pos < total:
        n = sock.recv_into(view[pos:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {pos} of {total} bytes")
        pos += n


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes (for headers and names, never payload)."""
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into_parts(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view of ``views`` in order from ``sock`` (``recvmsg_into`` over those not yet
    full); raise ``ConnectionError`` on EOF."""
    left, k = sum(len(v) for v in views), 0
    views = list(views)
    while left:
        n = sock.recvmsg_into(views[k:])[0]
        if n == 0:
            raise ConnectionError(f"peer closed the connection with {left} bytes of a vector left")
        left -= n
        k = advance(views, k, n)


def discard(sock: socket.socket, n: int, scratch: memoryview) -> None:
    """Read and drop ``n`` bytes using ``scratch`` as the landing buffer."""
    while n > 0:
        chunk = scratch[: min(n, len(scratch))]
        got = sock.recv_into(chunk)
        if got == 0:
            raise ConnectionError(f"peer closed the connection with {n} bytes left to discard")
        n -= got


def send_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """Send ``parts`` in order with as few ``sendmsg`` calls as the socket buffer allows."""
    views, k = [memoryview(p).cast("B") for p in parts], 0
    while k < len(views):
        k = advance(views, k, sock.sendmsg(views[k:]))


def advance(views: list[memoryview], k: int, n: int) -> int:
    """``n`` more bytes of ``views[k:]`` went through a scatter/gather call: the index of the first
    view not done, whose slice in ``views`` is cut to what is left of it."""
    while k < len(views) and n >= len(views[k]):
        n -= len(views[k])
        k += 1
    if n:
        views[k] = views[k][n:]
    return k


def refusal(status: int, message: str) -> str:
    """A refused request's reason, as its outcome reports it."""
    kind = WireStatus(status).name if status in WireStatus._value2member_map_ else str(status)
    return f"refused by peer ({kind}): {message}"


def tune_socket(sock: socket.socket, congestion: str | None = DEFAULT_CONGESTION) -> None:
    """Settings of every data-plane socket: no Nagle delay on the small headers, and ``congestion``
    as its TCP congestion control (None: the host's default; see ``DEFAULT_CONGESTION``)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode("ascii"))


CONGESTION_HELP = (
    "TCP congestion control of the KV data connections: Reno sends a burst at once, where a pacing"
    " default (BBR) spaces it out with timers; 'system' keeps the host's default"
)


def parse_congestion(value: str) -> str | None:
    """``--tcp-congestion``'s value: an algorithm's name, or ``system`` (None: the host's default)."""
    return None if value == "system" else value


def congestion_flag(congestion: str | None) -> str:
    """``congestion`` as ``--tcp-congestion`` names it (the inverse of :func:`parse_congestion`)."""
    return "system" if congestion is None else congestion


def check_congestion(congestion: str | None) -> None:
    """``ValueError`` saying what the host offers when this process cannot give a socket
    ``congestion`` as its congestion control (unknown to the kernel, or restricted to privileged
    processes); None (the host's default) always does."""
    if congestion is None:
        return
    if not congestion or not congestion.isascii() or not congestion.isprintable():
        raise ValueError(f"TCP congestion control must be a kernel algorithm's name, got {congestion!r}")
    try:
        with socket.socket() as probe:
            tune_socket(probe, congestion)
    except (OSError, AttributeError) as exc:  # AttributeError: no TCP_CONGESTION (not Linux)
        raise ValueError(
            f"cannot use TCP congestion control {congestion!r} here ({exc}); this process may use "
            f"{_sysctl('tcp_allowed_congestion_control')!r} (net.ipv4.tcp_allowed_congestion_control; a "
            f"privileged one any of {_sysctl('tcp_available_congestion_control')!r}), or the host's default "
            "(--tcp-congestion system)"
        ) from exc


def host_congestion() -> str:
    """The host's default TCP congestion control (net.ipv4.tcp_congestion_control), or "unknown"."""
    return _sysctl("tcp_congestion_control")


def _sysctl(name: str) -> str:
    try:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return f.read().strip()
    except OSError:
        return "unknown"
