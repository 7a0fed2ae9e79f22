"""When to restart a crashed child, and when to give up: exponential backoff and crash loops.

    exit -> ran healthy long enough? reset the backoff -> too many restarts in the window? give up
         -> else restart after the current backoff, then double it (up to the cap)

Pure bookkeeping: the caller passes the clock (``time.monotonic()`` seconds); nothing here sleeps
or starts processes (:mod:`yutu.launcher` does).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

INITIAL_BACKOFF_S = 0.5  # the first restart of a child waits this long
MAX_BACKOFF_S = 10.0  # the backoff doubles per restart up to this
HEALTHY_AFTER_S = 30.0  # a run this long counts as healthy: the next crash starts the backoff over
MAX_RESTARTS = 5  # more restarts than this within RESTART_WINDOW_S is a crash loop
RESTART_WINDOW_S = 60.0


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = INITIAL_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    healthy_after_s: float = HEALTHY_AFTER_S
    max_restarts: int = MAX_RESTARTS  # 0: never restart (any crash is fatal)
    window_s: float = RESTART_WINDOW_S

    def __post_init__(self) -> None:
        if self.initial_backoff_s <= 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"backoff must be positive and its cap at least the first delay, got "
                f"{self.initial_backoff_s}s..{self.max_backoff_s}s"
            )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"--restart-window must be positive, got {self.window_s}")
        if self.healthy_after_s <= 0:
            raise ValueError(f"healthy_after_s must be positive, got {self.healthy_after_s}")


class RestartHistory:
    """The restarts of one child under ``policy``."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.total = 0  # restarts so far, over the child's whole life
        self._recent: deque[float] = deque()  # when each restart in the window was decided
        self._backoff = policy.initial_backoff_s

    def after_exit(self, now: float, ran_for_s: float) -> float | None:
        """The delay before restarting a child that exited at ``now`` after running ``ran_for_s``;
        None when it is crash-looping (it was restarted ``max_restarts`` times within the window)."""
        p = self.policy
        if ran_for_s >= p.healthy_after_s:
            self._backoff = p.initial_backoff_s
        while self._recent and now - self._recent[0] > p.window_s:
            self._recent.popleft()
        if len(self._recent) >= p.max_restarts:
            return None
        delay = self._backoff
        self._backoff = min(self._backoff * 2, p.max_backoff_s)
        self._recent.append(now)
        self.total += 1
        return delay

    @property
    def recent(self) -> int:
        """Restarts decided within the last window (as of the latest exit)."""
        return len(self._recent)
