"""The conductor's memory of recent placements: predicted against measured TTFT, per request.

A bounded ring (``/placements/recent``); the gateway reports each request's measured TTFT with an
``Observed`` message and the prediction error goes into a histogram (``/metrics``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class PlacementRecord:
    request_id: str
    at: float  # wall clock of the placement
    policy: str
    prefill: str | None
    decode: str
    prompt_len: int
    local_blocks: int
    store_blocks: int
    predicted_ttft_s: float
    predicted_tbt_s: float
    reason: str
    priority: int = 0  # the request's (the engines serve a lower value first)
    measured_ttft_s: float | None = None
    cached_tokens: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RecentPlacements:
    def __init__(self, size: int) -> None:
        self.size = size
        self._records: OrderedDict[str, PlacementRecord] = OrderedDict()

    def add(self, record: PlacementRecord) -> None:
        self._records[record.request_id] = record
        self._records.move_to_end(record.request_id)
        while len(self._records) > self.size:
            self._records.popitem(last=False)

    def observe(self, request_id: str, ttft_s: float, cached_tokens: int) -> PlacementRecord | None:
        """Attach a measured TTFT; returns the record (None if it already left the ring)."""
        record = self._records.get(request_id)
        if record is not None:
            record.measured_ttft_s = ttft_s
            record.cached_tokens = cached_tokens
        return record

    def latest(self, limit: int) -> list[dict[str, Any]]:
        records = list(self._records.values())[-limit:]
        return [r.as_dict() for r in reversed(records)]
