"""Per-request sampling parameters (what to generate and when to stop).

Validation is done for what the sampler computes, in the dtype it computes in (float32 on the
logits' device, token indices as int64), so an accepted request can never make it produce NaN:

- ``top_p`` must stay > 0 once converted to float32: values below :data:`TOP_P_MIN` (the smallest
  positive float32, 2**-149) are refused rather than rounded to 0, which would mask every token.
  Tiny accepted values (subnormals included) keep the most likely token only.
- ``temperature`` below :data:`GREEDY_TEMPERATURE` is greedy (argmax); at or above it, the division
  ``logits / temperature`` in float32 is guarded by the sampler (a row whose largest scaled logit
  overflows is shifted by its maximum first). Temperatures beyond float32's range are refused.
- ``top_k`` and ``stop_token_ids`` are bounded to int64, the dtype of token indices (a ``top_k``
  larger than the vocabulary means no limit; a stop id outside it never matches).
- ``seed`` spans what ``torch.Generator.manual_seed`` takes; ``logprobs`` is at most 20 (the sampler
  takes ``min(k, vocab)`` alternatives, and reports a ``-inf`` logprob as float32's lowest);
  ``max_tokens`` is checked against the context by the engine (``PromptTooLongError``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # most top alternatives a request may ask for (OpenAI's limit)
GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (argmax)
MAX_TEMPERATURE = 3.4028234663852886e38  # the largest finite float32
TOP_P_MIN = 2.0**-149  # 1.401298464324817e-45, the smallest positive float32
INT64_MAX = 2**63 - 1
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed accepts [-2**63, 2**64 - 1]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_float(name: str, value: object, expected: str) -> float:
    """``value`` as a Python float; ValueError naming ``name`` if it is not a real number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float64
        raise ValueError(f"{name} must be {expected}, got an integer too large for a float") from None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated on construction: bad values raise ValueError.

    Stop *strings* are the caller's business (it detokenizes); the engine stops on token ids only.
    """

    temperature: float = 1.0  # in [0, MAX_TEMPERATURE]; 0 (or below GREEDY_TEMPERATURE) is greedy
    top_p: float = 1.0  # in [TOP_P_MIN, 1]: keep the smallest set of tokens whose probability reaches top_p
    top_k: int | None = None  # None: no limit; else keep the top_k most likely tokens (1 <= top_k < 2**63)
    seed: int | None = None  # per-request RNG seed: same seed -> same tokens, whatever the batch
    max_tokens: int = 16  # >= 1 tokens to generate at most
    stop_token_ids: tuple[int, ...] = ()  # generation stops after emitting any of these
    ignore_eos: bool = False  # keep generating past the model's eos tokens
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus top-k (k <= 20)

    def __post_init__(self) -> None:
        self._check_temperature()
        self._check_top_p()
        if self.top_k is not None and (not _is_int(self.top_k) or not 1 <= self.top_k <= INT64_MAX):
            raise ValueError(
                f"top_k must be an integer >= 1, or None to disable it (at most {INT64_MAX}; above the"
                f" vocabulary size means no limit); got {self.top_k!r}"
            )
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(
                f"seed must be an integer in [{_SEED_MIN}, {_SEED_MAX}] or None, got {self.seed!r}"
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        stop = self.stop_token_ids
        if not isinstance(stop, tuple | list) or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in stop):
            raise ValueError(
                f"stop_token_ids must be a sequence of integers >= 0 (at most {INT64_MAX}), got {stop!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(stop))  # normalise a list to a tuple
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}"
            )

    def _check_temperature(self) -> None:
        value = _as_float("temperature", self.temperature, "a number >= 0")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if value > MAX_TEMPERATURE:
            raise ValueError(
                f"temperature={self.temperature} overflows float32, the sampler's dtype: use at most"
                f" {MAX_TEMPERATURE} (in practice at most 2)"
            )

    def _check_top_p(self) -> None:
        value = _as_float("top_p", self.top_p, "a number in (0, 1]")
        if not (0.0 < value <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if value < TOP_P_MIN:  # it would round to 0 in float32 and mask every token
            raise ValueError(
                f"top_p must be >= {TOP_P_MIN!r} (2**-149, the smallest positive float32: the sampler computes"
                f" in float32, where a smaller top_p rounds to 0), got {self.top_p}; to keep only the most likely"
                " token, use top_k=1"
            )

    @property
    def is_greedy(self) -> bool:
        """Whether the token is the argmax (temperature 0); top_k/top_p/seed then do not matter."""
        return self.temperature < GREEDY_TEMPERATURE
