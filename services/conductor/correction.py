"""How far measured TTFTs run from predicted ones, so early rejection judges the real thing.

The cost models predict engine time; a client sees more (the gateway, placement, the handoff,
CPU shared with other processes). Every ``Observed`` TTFT updates an EWMA of
``r = log(measured / predicted)`` and an EWMA of its absolute deviation ``|r - mean|``; the factor
is ``exp(mean + deviation)``, and the conductor holds the policy to ``slo / factor``, so a request
is accepted only when its measured TTFT would likely meet the SLO, not merely as likely meet it as
miss it. (With the mean alone, ``--prefill 1 --decode 1`` under a burst of 80 prompts against a
1 s SLO accepted 30, of which 10 measured 1.15-1.22 s: the requests accepted at the edge missed
about half the time.) The factor is clamped to ``[1, MAX_FACTOR]``: it never loosens an SLO, and
one pathological sample cannot shut the door.
"""

from __future__ import annotations

import math

MAX_FACTOR = 8.0


class TTFTCorrection:
    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._log_ratio = 0.0  # EWMA of log(measured / predicted)
        self._log_dev = 0.0  # EWMA of |log ratio - the EWMA before it|
        self.samples = 0

    @property
    def factor(self) -> float:
        """measured / predicted TTFT, smoothed, plus its typical deviation, within [1, MAX_FACTOR]."""
        return min(MAX_FACTOR, max(1.0, math.exp(self._log_ratio + self._log_dev)))

    def observe(self, predicted_s: float, measured_s: float) -> None:
        if not (
            predicted_s > 0 and measured_s > 0 and math.isfinite(predicted_s) and math.isfinite(measured_s)
        ):
            return
        ratio = math.log(min(MAX_FACTOR, max(1 / MAX_FACTOR, measured_s / predicted_s)))
        self._log_dev += self.alpha * (abs(ratio - self._log_ratio) - self._log_dev)
        self._log_ratio += self.alpha * (ratio - self._log_ratio)
        self.samples += 1
