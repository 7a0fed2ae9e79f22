"""Wire format of the TCP data plane, and exact-length socket helpers.

Request  (client -> server), 32 bytes then ``name_len`` bytes of UTF-8 region name::

    magic "YUTU" | version u8 | op u8 | name_len u16 | request_id u64 | offset u64 | length u64

    op READ : server replies, then sends ``length`` payload bytes if the status is OK
    op WRITE: client sends ``length`` payload bytes right after the name; server replies after
              storing them (or after discarding them, when refused)
    op HELLO: first message on a connection; name = segment name, offset = incarnation. The server
              answers OK only if it is that very segment, so a reused port never receives writes
              meant for a dead peer.

Reply    (server -> client), 24 bytes then ``msg_len`` bytes of UTF-8 error text::

    magic "YUTU" | version u8 | status u8 | msg_len u16 | request_id u64 | length u64

All integers are big-endian. Offsets and lengths are unsigned on the wire: the client refuses
negative values before encoding, and the server checks ``offset + length <= region size``.
"""

from __future__ import annotations

import enum
import socket
import struct

MAGIC = b"YUTU"
VERSION = 1
REQUEST = struct.Struct("!4sBBHQQQ")
REPLY = struct.Struct("!4sBBHQQ")
MAX_NAME_BYTES = 1024
MAX_U64 = (1 << 64) - 1


class WireOp(enum.IntEnum):
    READ = 1
    WRITE = 2
    HELLO = 3


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


def discard(sock: socket.socket, n: int, scratch: memoryview) -> None:
    """Read and drop ``n`` bytes using ``scratch`` as the landing buffer."""
    while n > 0:
        chunk = scratch[: min(n, len(scratch))]
        got = sock.recv_into(chunk)
        if got == 0:
            raise ConnectionError(f"peer closed the connection with {n} bytes left to discard")
        n -= got


def send_all(sock: socket.socket, head: bytes, payload: memoryview) -> None:
    """Send ``head`` then ``payload`` with as few syscalls as possible (one ``sendmsg`` when the
    socket buffer takes it all), so a header never travels alone ahead of its payload."""
    sent = sock.sendmsg([head, payload])
    if sent < len(head):
        sock.sendall(head[sent:])
        sent = len(head)
    sock.sendall(payload[sent - len(head) :])


def tune_socket(sock: socket.socket) -> None:
    """Settings of every data-plane socket: no Nagle delay on the small headers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
