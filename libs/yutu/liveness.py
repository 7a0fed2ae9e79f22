"""Who has been heard from lately: the liveness judgement behind a channel's heartbeats.

A peer is *silent* once nothing came from it for longer than its window. :meth:`Liveness.expired`
reports each peer once when it turns silent; :meth:`Liveness.heard` says when a silent one is back.
The owner calls ``expired()`` from a periodic loop, so a check that comes later than a window after
the previous one means this process was stalled (SIGSTOP, a long GC pause, a blocked event loop),
not the peers: every window then restarts instead of blaming peers for our own silence::

    heard(a) ... heard(a) ...........(window)........ expired() -> [(a, silence)]    a is silent
    heard(a)  -> True                                                                a is back

The clock is injected, so the timing logic is tested without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Silent(Generic[K]):
    """A peer that just turned silent, and for how long nothing came from it."""

    key: K
    silence_s: float


class Liveness(Generic[K]):
    """Last-heard times of a set of peers, each judged against its own window (seconds)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ValueError(f"a liveness window must be positive, got {timeout_s}")
        self.timeout_s = timeout_s  # the window of peers watched without one of their own
        self._clock = clock
        self._last: dict[K, float] = {}  # peer -> when last heard (or first watched)
        self._window: dict[K, float] = {}
        self._answered: set[K] = set()  # heard at least once since watched
        self._silent: set[K] = set()  # reported by expired() and not heard since
        self._last_check: float | None = None

    def watch(self, key: K, timeout_s: float | None = None) -> None:
        """Start judging ``key`` now, as if just heard (it has a full window to say something)."""
        self._last[key] = self._clock()
        self._window[key] = self.timeout_s if timeout_s is None else timeout_s
        self._answered.discard(key)
        self._silent.discard(key)

    def heard(self, key: K, timeout_s: float | None = None) -> bool:
        """Record a sign of life from ``key`` (watching it if new); True if it had been silent.

        ``timeout_s`` changes the peer's window (a peer may declare its own, as a Ping does).
        """
        self._last[key] = self._clock()
        if timeout_s is not None:
            self._window[key] = timeout_s
        elif key not in self._window:
            self._window[key] = self.timeout_s
        self._answered.add(key)
        if key in self._silent:
            self._silent.discard(key)
            return True
        return False

    def expired(self) -> list[Silent[K]]:
        """Peers that turned silent since the last call, each reported once until heard again."""
        now = self._clock()
        previous, self._last_check = self._last_check, now
        gap = 0.0 if previous is None else now - previous
        newly: list[Silent[K]] = []
        for key, last in self._last.items():
            window = self._window[key]
            if gap > window:  # we were stalled ourselves: give the peer a fresh window
                self._last[key] = now
                continue
            silence = now - last
            if silence > window and key not in self._silent:
                self._silent.add(key)
                newly.append(Silent(key, silence))
        return newly

    def forget(self, key: K) -> None:
        """Stop judging ``key`` (it left)."""
        self._last.pop(key, None)
        self._window.pop(key, None)
        self._answered.discard(key)
        self._silent.discard(key)

    def is_silent(self, key: K) -> bool:
        return key in self._silent

    def has_answered(self, key: K) -> bool:
        """Whether ``key`` was heard from since it was watched (and is not silent now)."""
        return key in self._answered and key not in self._silent

    def silence_s(self, key: K) -> float:
        """Seconds since ``key`` was last heard (or watched)."""
        return self._clock() - self._last[key]

    def __contains__(self, key: object) -> bool:
        return key in self._last

    def __len__(self) -> int:
        return len(self._last)
