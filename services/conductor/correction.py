"""How far measured TTFTs run from predicted ones, so early rejection judges the real thing.

The cost models predict engine time; a client sees more (the gateway, placement, the handoff,
CPU shared with other processes). Every ``Observed`` TTFT updates an EWMA of
``log(measured / predicted)``; the conductor holds the policy to ``slo / factor`` so that a request
is rejected when its *measured* TTFT would likely miss the SLO. The factor is clamped to
``[1, MAX_FACTOR]``: it never loosens an SLO, and one pathological sample cannot shut the door.
"""

from __future__ import annotations

import math

MAX_FACTOR = 8.0


class TTFTCorrection:
    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._log_ratio = 0.0
        self.samples = 0

    @property
    def factor(self) -> float:
        """measured / predicted TTFT, smoothed, within [1, MAX_FACTOR]."""
        return min(MAX_FACTOR, max(1.0, math.exp(self._log_ratio)))

    def observe(self, predicted_s: float, measured_s: float) -> None:
        if not (
            predicted_s > 0 and measured_s > 0 and math.isfinite(predicted_s) and math.isfinite(measured_s)
        ):
            return
        ratio = math.log(min(MAX_FACTOR, max(1 / MAX_FACTOR, measured_s / predicted_s)))
        self._log_ratio += self.alpha * (ratio - self._log_ratio)
        self.samples += 1
