"""A bounded-window, non-negative, outlier-robust linear fit ``y ~ theta . x``: the engine of the cost models.

Contract:
- ``add(x, y)`` keeps the last ``window`` observations; features and targets are finite and >= 0.
- ``coefficients`` are the prior until ``min_samples`` observations arrived, and always finite and
  >= 0 (so with non-negative features a prediction is never negative). Fitting is lazy (on the first
  read after an ``add``) and deterministic: the same observations in the same order give the same
  coefficients.

The fit, over the window (errors are *relative*: times span orders of magnitude, and a 10 ms and a
10 s measurement should count alike):
1. Non-negative least squares by active sets: the weighted least-squares solution on every
   non-empty subset of features, keeping the feasible one (all coefficients >= 0) with the least
   weighted error. With three features that is seven tiny solves over one normal matrix, and it is
   the exact NNLS optimum.
2. A robust start: least absolute relative deviation, by iteratively reweighted least squares from
   a fit weighted by the prior's predictions. A few wild measurements (a stall, a cached no-op) barely
   move it, where squares would follow them.
3. Outliers: observations whose log ratio to that fit exceeds ``max(log 1.5, 5 * median)`` are
   dropped, and the rest fitted by relative least squares (exact on exact data).
4. Degenerate data (the window cannot tell the features apart, e.g. every sample has the same x):
   the prior's shape scaled by the median of ``y / prior(x)``, rather than an arbitrary exact fit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from itertools import combinations

import numpy as np
import numpy.ma  # noqa: F401 -- np.median imports it at its first call (20-70 ms): here, not mid-placement
from numpy.typing import NDArray

Vector = NDArray[np.float64]
Matrix = NDArray[np.float64]

_MIN_EIGEN = 1e-10  # of the unit-diagonal normal matrix: below it, features are (nearly) collinear
_IRLS_ROUNDS = 12  # enough to find the outliers; the final fit on the rest is exact
_IRLS_FLOOR = 1e-6  # relative residual below which a sample's L1 weight stops growing
_TRIM_MIN = math.log(1.5)
_TRIM_MEDIANS = 5.0


def nnls(x: Matrix, y: Vector, w: Vector, *, check_rank: bool = True) -> Vector | None:
    """Non-negative weighted least squares by active sets; None when the features are collinear.

    ``x``: (N, k) features, ``y``: (N,) targets, ``w``: (N,) weights > 0. ``check_rank=False`` skips
    the collinearity test (for a refit of samples already found independent).
    """
    a = (x * w[:, None]).T @ x  # (k, k) = X^T W X
    b = (x * w[:, None]).T @ y  # (k,)   = X^T W y
    diag = np.diag(a)
    if not np.all(diag > 0):
        return None
    d = np.sqrt(diag)
    an, bn = a / np.outer(d, d), b / d  # unit diagonal: conditioning independent of feature scales
    if check_rank and np.linalg.eigvalsh(an)[0] < _MIN_EIGEN:
        return None
    k = len(b)
    full = np.linalg.solve(an, bn)
    if np.all(full >= 0):  # the unconstrained optimum is feasible: it is the NNLS optimum
        return full / d
    best_gain, best = -math.inf, np.zeros(k)
    for size in range(k, 0, -1):
        for subset in combinations(range(k), size):
            idx = list(subset)
            sol = np.linalg.solve(an[np.ix_(idx, idx)], bn[idx])
            if np.any(sol < 0):
                continue
            gain = float(sol @ bn[idx])  # weighted error = y^T W y - gain
            if gain > best_gain:
                best_gain, best = gain, np.zeros(k)
                best[idx] = sol / d[idx]
    return best  # a single feature with x, y >= 0 always has a coefficient >= 0: never empty


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
        self._samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
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
            self._theta = self._fit()
        return self._theta

    def predict(self, x: Sequence[float]) -> float:
        """``theta . x``: finite and >= 0 for finite features >= 0."""
        return max(0.0, math.fsum(c * v for c, v in zip(self.coefficients, x, strict=True)))

    def _fit(self) -> tuple[float, ...]:
        if len(self._samples) < self.min_samples:
            return self.prior
        x = np.array([s[0] for s in self._samples], dtype=np.float64)  # (N, k)
        y = np.array([s[1] for s in self._samples], dtype=np.float64)  # (N,)
        floor = 1e-3 * float(np.median(y)) + 1e-12  # keeps relative weights finite near zero
        theta = self._robust_start(x, y, floor)
        if theta is None:
            return self._scaled_prior(x, y)
        fit = np.maximum(x @ theta, 0.0) + floor
        ratio = np.abs(np.log((y + floor) / fit))
        keep = ratio <= max(_TRIM_MIN, _TRIM_MEDIANS * float(np.median(ratio)))
        if int(keep.sum()) >= self.min_samples:
            final = nnls(x[keep], y[keep], 1.0 / fit[keep] ** 2)
            if final is not None:
                theta = final
        return tuple(float(c) for c in theta)

    def _robust_start(self, x: Matrix, y: Vector, floor: float) -> Vector | None:
        """Least absolute relative deviation by IRLS; None when the features are collinear."""
        scale = x @ np.array(self.prior) + floor
        theta = nnls(x, y, 1.0 / scale**2)
        if theta is None:
            return None
        for _ in range(_IRLS_ROUNDS):
            scale = np.maximum(x @ theta, 0.0) + floor
            rel = np.maximum(np.abs(y - x @ theta) / scale, _IRLS_FLOOR)
            nxt = nnls(x, y, 1.0 / (scale**2 * rel), check_rank=False)
            if nxt is None:
                break
            done = np.allclose(nxt, theta, rtol=1e-9, atol=0.0)
            theta = nxt
            if done:
                break
        return theta

    def _scaled_prior(self, x: Matrix, y: Vector) -> tuple[float, ...]:
        base = x @ np.array(self.prior)
        ok = base > 0
        scale = float(np.median(y[ok] / base[ok])) if np.any(ok) else 1.0
        return tuple(c * scale for c in self.prior)
