"""Cost models fitted online: prefill time, KV transfer time, decode step time (TBT).

Each model is a plain object: the caller feeds measurements with ``observe(...)`` (durations it timed,
in seconds) and the policies call ``predict(...)``. No clock, no I/O; deterministic: the same
observations in the same order give the same predictions. Before enough data a model predicts from
its prior; predictions are always finite and >= 0. A model is *calibrated* once it has
``min_samples`` measurements, or when its prior is trusted (``trusted=True``: measured elsewhere,
e.g. a calibration profile); early rejection only believes calibrated models, since an untrusted
prior describes no real machine. Invalid measurements (negative, NaN, infinite)
raise ValueError: they are bugs in the caller, not data.

- Prefill (Mooncake FAST'25 §4.1 fits a polynomial in the prompt and prefix lengths): computing
  tokens ``[p, L)`` of an ``L``-token prompt costs ``a + b*n + c*n*(L + p)`` with ``n = L - p``; the
  last term is attention of the ``n`` new tokens over a context that grows from ``p`` to ``L``
  (``sum_{i=p}^{L-1} i ~ n*(L+p)/2``). Fitted by :class:`~yutu.sched.regression.WindowFit`.
- Transfer: ``latency + bytes / bandwidth``, the bandwidth an EWMA (in log space) of observed
  ``bytes / (seconds - latency)``, each sample clamped to within 16x of the current estimate so one
  stall or one cached read cannot swing it.
- Decode step: ``a + b*batch + c*kv_tokens`` (per-sequence work plus reading every KV token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from yutu.sched.regression import WindowFit

# Priors: a modest accelerator; real numbers replace them after min_samples measurements.
PREFILL_PRIOR = (0.01, 1e-4, 1e-9)  # s, s/token, s/token^2
DECODE_PRIOR = (0.01, 2e-4, 1e-8)  # s, s/sequence, s/KV token
TRANSFER_PRIOR_BPS = 2e9
TRANSFER_LATENCY_S = 1e-3
_SAMPLE_CLAMP = 16.0


def _check_tokens(prompt_len: int, reused_tokens: int) -> None:
    if prompt_len < 1 or not 0 <= reused_tokens <= prompt_len:
        raise ValueError(
            f"need prompt_len >= 1 and 0 <= reused_tokens <= prompt_len, got {prompt_len}, {reused_tokens}"
        )


def _check_seconds(seconds: float) -> None:
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a measured duration must be finite and >= 0, got {seconds!r}")


class _FittedModel:
    """A model fitted online on three features (``WindowFit``), from a prior until calibrated."""

    def __init__(
        self, prior: tuple[float, float, float], window: int, min_samples: int, trusted: bool
    ) -> None:
        self._fit = WindowFit(prior, window=window, min_samples=min_samples)
        self.trusted = trusted  # the prior is a measurement (a profile), not a guess

    @property
    def calibrated(self) -> bool:
        """Whether predictions rest on measurements (enough samples, or a trusted prior)."""
        return self.trusted or self._fit.num_samples >= self._fit.min_samples


class PrefillCostModel(_FittedModel):
    """Predicts the compute time of a prefill from (prompt length, reused prefix tokens)."""

    def __init__(
        self,
        prior: tuple[float, float, float] = PREFILL_PRIOR,
        *,
        window: int = 256,
        min_samples: int = 8,
        trusted: bool = False,
    ) -> None:
        super().__init__(prior, window, min_samples, trusted)

    @staticmethod
    def features(prompt_len: int, reused_tokens: int) -> tuple[float, float, float]:
        """``[1, n, n*(L+p)]`` with ``n = L - p`` new tokens."""
        _check_tokens(prompt_len, reused_tokens)
        n = prompt_len - reused_tokens
        return (1.0, float(n), float(n * (prompt_len + reused_tokens)))

    def observe(self, prompt_len: int, reused_tokens: int, seconds: float) -> None:
        """Record that computing tokens ``[reused_tokens, prompt_len)`` took ``seconds``."""
        _check_seconds(seconds)
        self._fit.add(self.features(prompt_len, reused_tokens), seconds)

    def predict(self, prompt_len: int, reused_tokens: int) -> float:
        """Seconds to compute tokens ``[reused_tokens, prompt_len)``."""
        return self._fit.predict(self.features(prompt_len, reused_tokens))

    @property
    def coefficients(self) -> tuple[float, ...]:
        """``(a, b, c)`` now: s, s/token, s/token^2."""
        return self._fit.coefficients


class TransferCostModel:
    """Predicts the time of one batched store read from its size."""

    def __init__(
        self,
        prior_bandwidth_bps: float = TRANSFER_PRIOR_BPS,
        *,
        latency_s: float = TRANSFER_LATENCY_S,
        alpha: float = 0.2,
    ) -> None:
        if not (math.isfinite(prior_bandwidth_bps) and prior_bandwidth_bps > 0):
            raise ValueError(f"prior_bandwidth_bps must be finite and > 0, got {prior_bandwidth_bps!r}")
        if not (math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"latency_s must be finite and >= 0, got {latency_s!r}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.latency_s = latency_s
        self.alpha = alpha
        self._bw = float(prior_bandwidth_bps)
        self._log_bw = math.log(prior_bandwidth_bps)
        self.num_samples = 0

    @property
    def bandwidth_bps(self) -> float:
        """The current bandwidth estimate in bytes/s."""
        return self._bw

    def observe(self, nbytes: int, seconds: float) -> None:
        """Record that reading ``nbytes`` took ``seconds``; a zero-byte read says nothing and is skipped."""
        _check_seconds(seconds)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:
            return
        current = self.bandwidth_bps
        net = seconds - self.latency_s
        sample = nbytes / net if net > 0 else current * _SAMPLE_CLAMP
        sample = min(current * _SAMPLE_CLAMP, max(current / _SAMPLE_CLAMP, sample))
        self._log_bw += self.alpha * (math.log(sample) - self._log_bw)
        self._bw = math.exp(self._log_bw)
        self.num_samples += 1

    def predict(self, nbytes: int, bandwidth_bps: float | None = None) -> float:
        """Seconds to read ``nbytes`` (0 for nothing), at ``bandwidth_bps`` if given (an instance's
        measured bandwidth), else at the model's estimate."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:
            return 0.0
        bw = self.bandwidth_bps if bandwidth_bps is None else bandwidth_bps
        return self.latency_s + nbytes / bw


class DecodeCostModel(_FittedModel):
    """Predicts one decode step's duration (the TBT) from batch size and total KV tokens."""

    def __init__(
        self,
        prior: tuple[float, float, float] = DECODE_PRIOR,
        *,
        window: int = 256,
        min_samples: int = 8,
        trusted: bool = False,
    ) -> None:
        super().__init__(prior, window, min_samples, trusted)

    @staticmethod
    def features(batch_size: int, kv_tokens: int) -> tuple[float, float, float]:
        if batch_size < 0 or kv_tokens < 0:
            raise ValueError(f"batch_size and kv_tokens must be >= 0, got {batch_size}, {kv_tokens}")
        return (1.0, float(batch_size), float(kv_tokens))

    def observe(self, batch_size: int, kv_tokens: int, seconds: float) -> None:
        """Record that one step over ``batch_size`` sequences holding ``kv_tokens`` took ``seconds``."""
        _check_seconds(seconds)
        self._fit.add(self.features(batch_size, kv_tokens), seconds)

    def predict(self, batch_size: int, kv_tokens: int) -> float:
        """Seconds per decode step at this load."""
        return self._fit.predict(self.features(batch_size, kv_tokens))

    @property
    def coefficients(self) -> tuple[float, ...]:
        """``(a, b, c)`` now: s, s/sequence, s/KV token."""
        return self._fit.coefficients


@dataclass
class CostModels:
    """The three models a policy consults; the caller owns them and feeds their ``observe``."""

    prefill: PrefillCostModel = field(default_factory=PrefillCostModel)
    transfer: TransferCostModel = field(default_factory=TransferCostModel)
    decode: DecodeCostModel = field(default_factory=DecodeCostModel)

    def fit(self) -> None:
        """Fit the prefill and decode models on what they observed now, rather than lazily at the
        next prediction: a caller that observes off the request path (the conductor, after each load
        report) keeps the fit out of its placements. The coefficients are the same either way."""
        _ = self.prefill.coefficients, self.decode.coefficients
