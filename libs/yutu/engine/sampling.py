"""Per-request sampling parameters (what to generate and when to stop)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # most top alternatives a request may ask for (OpenAI's limit)
GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (argmax)
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed accepts [-2**63, 2**64 - 1]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated on construction: bad values raise ValueError.

    Stop *strings* are the caller's business (it detokenizes); the engine stops on token ids only.
    """

    temperature: float = 1.0  # >= 0; 0 (or below GREEDY_TEMPERATURE) is greedy
    top_p: float = 1.0  # in (0, 1]: keep the smallest set of tokens whose probability reaches top_p
    top_k: int | None = None  # None: no limit; else keep the top_k most likely tokens (>= 1)
    seed: int | None = None  # per-request RNG seed: same seed -> same tokens, whatever the batch
    max_tokens: int = 16  # >= 1 tokens to generate at most
    stop_token_ids: tuple[int, ...] = ()  # generation stops after emitting any of these
    ignore_eos: bool = False  # keep generating past the model's eos tokens
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus top-k (k <= 20)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1, or None to disable it; got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(
                f"seed must be an integer in [{_SEED_MIN}, {_SEED_MAX}] or None, got {self.seed!r}"
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        stop = self.stop_token_ids
        if not isinstance(stop, tuple | list) or not all(_is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids must be a sequence of integers >= 0, got {stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stop))  # normalise a list to a tuple
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}"
            )

    @property
    def is_greedy(self) -> bool:
        """Whether the token is the argmax (temperature 0); top_k/top_p/seed then do not matter."""
        return self.temperature < GREEDY_TEMPERATURE
