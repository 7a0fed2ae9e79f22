"""Typed errors of the transfer engine.

Bad input raises at the call site (``ValueError`` subclasses below); failures of a single transfer
request never raise out of a batch: they become a ``TransferResult`` with status FAILED or TIMED_OUT
and the message of one of these errors.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every error raised by ``yutu.transfer``."""


class RegionError(TransferError, ValueError):
    """A region name, size or range is invalid (unknown, duplicate, out of bounds)."""


class OutOfRangeError(RegionError):
    """An ``offset``/``length`` pair does not lie inside a registered region."""


class SegmentNotFoundError(TransferError):
    """The named segment is not (or no longer) published in the segment directory."""


class SegmentConflictError(TransferError):
    """Another live engine already publishes a segment under this name."""


class TransportUnavailableError(TransferError, ValueError):
    """A transport was requested that this build or this peer does not offer."""


class PeerError(TransferError):
    """The peer failed while serving a request (connection reset, EOF, protocol error)."""


class PeerUnreachableError(PeerError):
    """The peer could not be reached at all: nothing was transferred (connect or handshake failed,
    shared-memory file gone). The engine may retry such a request once after refreshing the
    peer's descriptor."""


class RemoteRefusedError(TransferError):
    """The peer's data server refused a request (unknown region, out of range) and touched nothing."""


class TransferTimeoutError(TransferError):
    """The request did not finish before its deadline."""
