"""A prefill instance's holds: KV blocks kept for a decode instance to pull, under a lease.

After a prefill samples a request's first token, the request's blocks stay allocated (the engine
keeps its block table) until the decode that pulls them says so (``release``), or the lease runs
out because the decode never came (it died, the client went away). Every way out calls
``on_release(request_id)`` exactly once; that frees the blocks on the engine thread.

Pure bookkeeping: the caller passes the time, so tests drive it with a fake clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Hold:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    expires_at: float


class Holds:
    def __init__(self, lease_s: float, on_release: Callable[[str], None]) -> None:
        if lease_s <= 0:
            raise ValueError(f"the KV hold lease must be positive, got {lease_s}")
        self.lease_s = lease_s
        self._on_release = on_release
        self._holds: dict[str, Hold] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries are skipped
        self.released = 0  # by the decode
        self.expired = 0  # by the lease
        self.undelivered = 0  # its handle never reached anyone (the gateway's connection was gone)

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._holds

    def get(self, request_id: str) -> Hold | None:
        return self._holds.get(request_id)

    @property
    def held_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self._holds.values())

    def add(self, request_id: str, block_ids: list[int], num_tokens: int, now: float) -> Hold:
        if request_id in self._holds:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        hold = Hold(request_id, list(block_ids), num_tokens, now + self.lease_s)
        self._holds[request_id] = hold
        heapq.heappush(self._deadlines, (hold.expires_at, request_id))
        return hold

    def renew(self, request_id: str, now: float) -> bool:
        """Extend the lease by ``lease_s`` from now; False if there is no such hold (any more)."""
        hold = self._holds.get(request_id)
        if hold is None:
            return False
        hold.expires_at = now + self.lease_s
        heapq.heappush(self._deadlines, (hold.expires_at, request_id))
        return True

    def release(self, request_id: str) -> bool:
        """The decode pulled the blocks (or gave up on them); False if not held (expired, unknown)."""
        freed = self._free(request_id)
        self.released += freed
        return freed

    def undeliverable(self, request_id: str) -> bool:
        """The handle could not be sent (nobody can pull the blocks): free them now, not at the
        lease's end; False if not held."""
        freed = self._free(request_id)
        self.undelivered += freed
        return freed

    def _free(self, request_id: str) -> bool:
        if self._holds.pop(request_id, None) is None:
            return False
        self._on_release(request_id)
        return True

    def expire(self, now: float) -> list[str]:
        """Release every hold whose lease ended by ``now``; returns their request ids."""
        gone: list[str] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, request_id = heapq.heappop(self._deadlines)
            hold = self._holds.get(request_id)
            if hold is None or hold.expires_at != deadline:
                continue  # released, or renewed (a later entry stands for it)
            del self._holds[request_id]
            self.expired += 1
            self._on_release(request_id)
            gone.append(request_id)
        return gone

    def release_all(self) -> int:
        """Release every hold (shutdown); returns how many."""
        ids = list(self._holds)
        for request_id in ids:
            del self._holds[request_id]
            self._on_release(request_id)
        return len(ids)

    def next_deadline(self) -> float | None:
        return min((h.expires_at for h in self._holds.values()), default=None)
