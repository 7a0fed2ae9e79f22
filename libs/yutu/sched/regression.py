"""A bounded-window, non-negative, outlier-trimmed linear fit ``y ~ theta . x``: the engine of the cost models.

Contract:
- ``add(x, y)`` keeps the last ``window`` observations; features and targets are finite and >= 0.
- ``coefficients`` are the prior until ``min_samples`` observations arrived, and always finite and
  >= 0 (so with non-negative features a prediction is never negative). Fitting is lazy (on the first
  read after an ``add``) and deterministic: the same observations in the same order give the same
  coefficients.

The fit, over the window:
1. Weighted least squares on relative error: weight ``1 / prior(x)^2``, so a 10 ms and a 10 s
   measurement count alike (times span orders of magnitude) and no weight depends on a noisy ``y``.
2. Non-negativity by active sets: the least-squares solution on every non-empty subset of features,
   keeping the feasible one (all coefficients >= 0) with the least weighted error. With three
   features that is seven tiny solves over one normal matrix, and it is the exact NNLS optimum.
3. Outliers: observations whose relative residual exceeds ``max(0.5, 5 * median residual)`` are
   dropped and the fit repeated once, weighted by the first fit's predictions.
4. Degenerate data (the window cannot tell the features apart, e.g. every sample has the same x):
   the prior's shape scaled by the median of ``y / prior(x)``, rather than an arbitrary exact fit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from itertools import combinations
from statistics import median

_TINY = 1e-12
_PIVOT_TOL = 1e-9  # on the unit-diagonal normal matrix: below it, features are (nearly) collinear
_TRIM_MIN = 0.5
_TRIM_MEDIANS = 5.0

Sample = tuple[tuple[float, ...], float]


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return math.fsum(x * y for x, y in zip(a, b, strict=True))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve ``a @ t = b`` (small, symmetric) by Gaussian elimination with partial pivoting.

    Returns None when a pivot falls below ``_PIVOT_TOL`` (the system is, for our purposes, singular).
    """
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < _PIVOT_TOL:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    t = [0.0] * n
    for r in range(n - 1, -1, -1):
        t[r] = (m[r][n] - sum(m[r][c] * t[c] for c in range(r + 1, n))) / m[r][r]
    return t


def nnls(samples: Sequence[Sample], weights: Sequence[float]) -> tuple[float, ...] | None:
    """Non-negative weighted least squares by active sets; None when the features are collinear."""
    k = len(samples[0][0])
    # Normal equations A t = b with A = X^T W X, b = X^T W y, rescaled to a unit diagonal.
    a = [
        [math.fsum(w * x[i] * x[j] for (x, _), w in zip(samples, weights, strict=True)) for j in range(k)]
        for i in range(k)
    ]
    b = [math.fsum(w * x[i] * y for (x, y), w in zip(samples, weights, strict=True)) for i in range(k)]
    if min(a[i][i] for i in range(k)) <= 0:
        return None
    d = [math.sqrt(a[i][i]) for i in range(k)]
    an = [[a[i][j] / (d[i] * d[j]) for j in range(k)] for i in range(k)]
    bn = [b[i] / d[i] for i in range(k)]
    if _solve(an, bn) is None:
        return None
    best: tuple[float, list[float]] | None = None
    for size in range(k, 0, -1):
        for subset in combinations(range(k), size):
            sol = _solve([[an[i][j] for j in subset] for i in subset], [bn[i] for i in subset])
            if sol is None or min(sol) < 0:
                continue
            gain = _dot(sol, [bn[i] for i in subset])  # weighted error = y^T W y - gain
            if best is None or gain > best[0]:
                full = [0.0] * k
                for i, v in zip(subset, sol, strict=True):
                    full[i] = v / d[i]
                best = (gain, full)
    assert best is not None  # a single feature with x, y >= 0 always has a coefficient >= 0
    return tuple(best[1])


class WindowFit:
    """Fits ``y ~ theta . x`` over the last ``window`` observations; see the module docstring."""

    def __init__(self, prior: Sequence[float], *, window: int = 256, min_samples: int = 8) -> None:
        if not prior or any(not math.isfinite(p) or p < 0 for p in prior) or not any(p > 0 for p in prior):
            raise ValueError(f"prior coefficients must be finite, >= 0 and not all zero, got {list(prior)}")
        if window < min_samples or min_samples < len(prior):
            raise ValueError(
                f"need window ({window}) >= min_samples ({min_samples}) >= number of features ({len(prior)})"
            )
        self.prior = tuple(float(p) for p in prior)
        self.min_samples = min_samples
        self._samples: deque[Sample] = deque(maxlen=window)
        self._theta: tuple[float, ...] | None = self.prior

    def add(self, x: Sequence[float], y: float) -> None:
        """Record one observation; raises ValueError on a wrong length, a negative or non-finite value."""
        if len(x) != len(self.prior):
            raise ValueError(f"expected {len(self.prior)} features, got {len(x)}")
        if any(not math.isfinite(v) or v < 0 for v in (*x, y)):
            raise ValueError(f"features and target must be finite and >= 0, got x={list(x)} y={y}")
        self._samples.append((tuple(float(v) for v in x), float(y)))
        self._theta = None

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    @property
    def coefficients(self) -> tuple[float, ...]:
        """The current coefficients (the prior before ``min_samples`` observations), each >= 0."""
        if self._theta is None:
            self._theta = self._fit(list(self._samples))
        return self._theta

    def predict(self, x: Sequence[float]) -> float:
        """``theta . x``: finite and >= 0 for finite features >= 0."""
        return max(0.0, _dot(self.coefficients, x))

    def _fit(self, samples: list[Sample]) -> tuple[float, ...]:
        if len(samples) < self.min_samples:
            return self.prior
        first = nnls(samples, [1.0 / max(_dot(self.prior, x), _TINY) ** 2 for x, _ in samples])
        if first is None:
            return self._scaled_prior(samples)
        predicted = [max(_dot(first, x), _TINY) for x, _ in samples]
        residuals = [abs(y - p) / p for (_, y), p in zip(samples, predicted, strict=True)]
        cutoff = max(_TRIM_MIN, _TRIM_MEDIANS * median(residuals))
        kept = [(s, p) for s, p, r in zip(samples, predicted, residuals, strict=True) if r <= cutoff]
        if len(kept) < self.min_samples:
            return first
        second = nnls([s for s, _ in kept], [1.0 / p**2 for _, p in kept])
        return first if second is None else second

    def _scaled_prior(self, samples: list[Sample]) -> tuple[float, ...]:
        ratios = [y / p for x, y in samples if (p := _dot(self.prior, x)) > _TINY]
        scale = median(ratios) if ratios else 1.0
        return tuple(c * scale for c in self.prior)
