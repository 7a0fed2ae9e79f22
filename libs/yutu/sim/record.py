"""What happened to one request in a simulation: where it ran, what it reused, its latencies."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

TBT_WORST_FRACTION = 0.10  # the paper's TBT: the mean of each request's longest 10% token gaps


@dataclass(slots=True)
class RequestRecord:
    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    prefill_id: str | None = None  # None with a decode_id: the decode instance prefilled it itself
    decode_id: str | None = None
    predicted_ttft_s: float | None = None
    local_blocks: int = 0  # reused from the prefill instance's own cache (as run, not as planned)
    fetched_blocks: int = 0  # read from the store
    queue_s: float = 0.0
    transfer_s: float = 0.0
    prefill_s: float = 0.0  # compute time spent on its prefill
    first_token_s: float | None = None  # absolute time of the first token (end of prefill)
    finish_s: float | None = None  # absolute time of the last token
    tbt_s: float | None = None  # mean of the worst 10% gaps between the tokens the decode emitted
    tpot_s: float | None = None  # (last token - first token) / (tokens - 1): everything included
    handoff_s: float | None = None  # first token to the decode's first: KV transfer and wait for a slot
    rejected: str | None = None  # a RejectCause value, or "decode_tbt" (rejected after prefill)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def completed(self) -> bool:
        return self.finish_s is not None

    def finish(self, at: float, gaps: list[float]) -> None:
        """The last token came at ``at``; ``gaps`` are the intervals between its tokens, the first
        one from the prefill's token to the decode's first. The TBT is judged on the decode's gaps
        (``gaps[1:]``: its steps, stalls included); the first gap is the handoff, kept apart."""
        self.finish_s = at
        self.handoff_s = gaps[0] if gaps else 0.0
        self.tbt_s = worst_gaps_mean(gaps[1:])
        assert self.first_token_s is not None
        self.tpot_s = (at - self.first_token_s) / len(gaps) if gaps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "arrival_s": self.arrival_s,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "prefill": self.prefill_id,
            "decode": self.decode_id,
            "local_blocks": self.local_blocks,
            "fetched_blocks": self.fetched_blocks,
            "queue_s": self.queue_s,
            "transfer_s": self.transfer_s,
            "prefill_s": self.prefill_s,
            "predicted_ttft_s": self.predicted_ttft_s,
            "ttft_s": self.ttft_s,
            "tbt_s": self.tbt_s,
            "tpot_s": self.tpot_s,
            "handoff_s": self.handoff_s,
            "finish_s": self.finish_s,
            "rejected": self.rejected,
        }


def worst_gaps_mean(gaps: list[float]) -> float:
    """Mean of the longest ``ceil(10%)`` of ``gaps`` (0 when there are none)."""
    if not gaps:
        return 0.0
    k = max(1, math.ceil(TBT_WORST_FRACTION * len(gaps)))
    return math.fsum(heapq.nlargest(k, gaps)) / k
