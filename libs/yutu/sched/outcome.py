"""What a policy answers: a :class:`Placement` (where to run and how to get the prefix) or a
:class:`Rejection` (why not, and when to try again).

A placement's prefix plan, in blocks of the request (``bs`` = block size, ``L`` = prompt length)::

    [0, local_blocks)             reused from the chosen instance's own prefix cache
    [fetch_start, fetch_end)      read from the store in one batched read (fetch_start == local_blocks;
                                  empty when fetch_end == fetch_start)
    tokens [fetch_end * bs, L)    computed: compute_tokens = L - fetch_end * bs >= 1

The chosen instance is the prefill instance, or the decode instance when ``prefill_id`` is None
(conditional disaggregation: the decode prefills the short uncached remainder itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from yutu.errors import ErrorKind


@dataclass(frozen=True)
class PrefixPlan:
    """How the chosen instance gets the request's KV: reuse, fetch, compute (see the module docstring)."""

    local_blocks: int
    fetch_end: int
    compute_tokens: int

    def __post_init__(self) -> None:
        assert 0 <= self.local_blocks <= self.fetch_end, self
        assert self.compute_tokens >= 1, self

    @property
    def fetch_start(self) -> int:
        """First block read from the store; always the end of the local prefix."""
        return self.local_blocks

    @property
    def fetch_blocks(self) -> int:
        """Blocks read from the store."""
        return self.fetch_end - self.local_blocks


@dataclass(frozen=True)
class Placement:
    """Run the request's prefill on ``prefill_id`` (None: on the decode) and its decode on ``decode_id``.

    ``ttft_s``: predicted TTFT -- the time the request already waited (``RequestView.waited_s``)
    plus, from ``now``, queue + transfer + prefill.
    ``ready_at_s``: ``now`` + queue + transfer + prefill, when the decode instance should expect
    it; the caller lists it as an ``IncomingDecode`` of that instance until its prefill ends.
    ``tbt_s``: predicted time between tokens on the decode instance once the request joins its
    batch. ``reason``: one line for logs.
    """

    request_id: str
    prefill_id: str | None
    decode_id: str
    plan: PrefixPlan
    ttft_s: float
    tbt_s: float
    ready_at_s: float
    policy: str
    reason: str

    @property
    def local_prefill(self) -> bool:
        """True when the decode instance prefills the request itself."""
        return self.prefill_id is None


class RejectCause(StrEnum):
    """Why a request was not placed; each maps to one error kind at the edge."""

    NO_DECODE = "no_decode_instance"  # none live: 503
    NO_CAPACITY = "no_capacity"  # live, but none has the KV blocks or batch room now: 429
    TTFT_SLO = "ttft_slo"  # the best placement predicts a TTFT above the SLO: 429
    TBT_SLO = "tbt_slo"  # the best placement predicts a TBT above the SLO: 429

    @property
    def error_kind(self) -> ErrorKind:
        return ErrorKind.UNAVAILABLE if self is RejectCause.NO_DECODE else ErrorKind.OVERLOADED


@dataclass(frozen=True)
class Rejection:
    """The request is not placed now.

    ``ttft_s`` / ``tbt_s``: what the best placement predicted (None when there was none).
    ``retry_after_s``: when trying again may succeed, in [1, 30] seconds (for ``Retry-After``).
    """

    request_id: str
    cause: RejectCause
    reason: str
    retry_after_s: float
    policy: str
    ttft_s: float | None = None
    tbt_s: float | None = None

    @property
    def error_kind(self) -> ErrorKind:
        """OVERLOADED (429 with Retry-After) or UNAVAILABLE (503)."""
        return self.cause.error_kind


RETRY_MIN_S = 1.0
RETRY_MAX_S = 30.0


def clamp_retry(seconds: float) -> float:
    """``seconds`` clamped to [RETRY_MIN_S, RETRY_MAX_S]; NaN or infinity give RETRY_MAX_S."""
    if seconds != seconds or seconds == float("inf"):
        return RETRY_MAX_S
    return min(RETRY_MAX_S, max(RETRY_MIN_S, seconds))
