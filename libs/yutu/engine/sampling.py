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
- ``presence_penalty`` and ``frequency_penalty`` lie in [-2, 2] (OpenAI's range), ``logit_bias``
  values in [-100, 100]; ``repetition_penalty`` is > 0 in float32 and finite. The sampler clamps
  the logits they touch to float32's finite range, so no bias or penalty can make a row infinite.
  ``logit_bias`` token ids are checked against the model's vocabulary by the engine.
- ``allowed_token_ids`` is None or a non-empty sequence of distinct token ids; ``bad_words`` is a
  sequence of non-empty token-id sequences. Ids are integers in [0, INT64_MAX] here, checked against
  the model's vocabulary by the engine (as ``logit_bias``'s). The sampler masks to float32's lowest,
  after the bias and penalties, so nothing lifts a masked token back up.
- ``grammar`` is a string; whether it compiles is the engine's to check (it needs the vocabulary).
  ``grammar_after_thinking`` is None or (start token, end token, opened) of a reasoning model's
  thinking markers, distinct ids checked against the vocabulary by the engine, with a grammar only.
- ``seed`` spans what ``torch.Generator.manual_seed`` takes; ``logprobs`` is at most 20 (the sampler
  takes ``min(k, vocab)`` alternatives, and reports a ``-inf`` logprob as float32's lowest);
  ``max_tokens`` is checked against the context by the engine (``PromptTooLongError``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # most top alternatives a request may ask for (OpenAI's limit)
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's)
GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (argmax)
MAX_TEMPERATURE = 3.4028234663852886e38  # the largest finite float32
TOP_P_MIN = 2.0**-149  # 1.401298464324817e-45, the smallest positive float32
INT64_MAX = 2**63 - 1
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed accepts [-2**63, 2**64 - 1]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: object) -> bool:
    """Whether ``value`` is a token id this class accepts (the engine checks it against its vocabulary)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT64_MAX


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
    # in [0, 1]: keep the tokens at least min_p times as likely as the most likely (after temperature,
    # before top-k and top-p: vLLM's order); 0 disables it
    min_p: float = 0.0
    seed: int | None = None  # per-request RNG seed: same seed -> same tokens, whatever the batch
    max_tokens: int = 16  # >= 1 tokens to generate at most
    min_tokens: int = 0  # in [0, max_tokens]: the eos and stop tokens are held back until this many are out
    stop_token_ids: tuple[int, ...] = ()  # generation stops after emitting any of these
    ignore_eos: bool = False  # keep generating past the model's eos tokens
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus top-k (k <= 20)
    # The prompt's tokens' logprobs (each under the prompt before it), like ``logprobs``: k alternatives.
    # The engine then computes the whole prompt (no prefix-cache or imported KV for it).
    prompt_logprobs: int | None = None
    # Logit adjustments, applied in this order before temperature, top-k and top-p (vLLM's order),
    # then min_tokens' hold on the eos and stop tokens; logprobs stay those of the raw logits.
    # logit_bias: (token id, bias added to its logit), ids distinct. repetition_penalty (> 0): a
    # logit of a token of the prompt or output is divided by it when > 0, multiplied when not.
    # frequency_penalty (in [-2, 2]) is taken off a token's logit once per time it was generated,
    # presence_penalty (in [-2, 2]) once if it was generated at all.
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Masks, applied after those (vLLM's semantics). allowed_token_ids: None, every token; else only
    # these distinct ids may be sampled (an eos too only if listed). bad_words: already-tokenized
    # words (the gateway tokenizes the strings): a word's last token is banned at a step where the
    # output so far ends with the rest of it (a one-token word: always); the prompt does not count.
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    # Structured outputs: the output follows this llguidance grammar (yutu.engine.structured builds
    # it from a JSON schema, a regex, choices or a Lark grammar); only its tokens are sampled, and the
    # request ends once the grammar is complete. Compiled against the vocabulary by the engine.
    grammar: str | None = None
    # A reasoning model's thinking goes unconstrained: (start, end, opened) -- the grammar holds from
    # the token after ``end``, or (opened False) from the first token unless that is ``start``
    # (which the first token's mask allows beside the grammar's); opened: the prompt ended in ``start``.
    grammar_after_thinking: tuple[int, int, bool] | None = None

    def __post_init__(self) -> None:
        self._check_temperature()
        self._check_top_p()
        if not 0.0 <= _as_float("min_p", self.min_p, "a number in [0, 1]") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
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
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
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
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}"
            )
        self._check_adjustments()
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError(f"grammar must be a non-empty string or None, got {self.grammar!r}")
        self._check_thinking()

    def _check_thinking(self) -> None:
        gate = self.grammar_after_thinking
        if gate is None:
            return
        if (
            not isinstance(gate, tuple | list) or len(gate) != 3 or not _is_token(gate[0])
            or not _is_token(gate[1]) or gate[0] == gate[1] or not isinstance(gate[2], bool)
        ):  # fmt: skip
            raise ValueError(
                "grammar_after_thinking must be (start token, end token, opened): two distinct token ids"
                f" and a bool, or None; got {gate!r}"
            )
        if self.grammar is None:
            raise ValueError("grammar_after_thinking defers a grammar: give one (grammar is None)")
        object.__setattr__(self, "grammar_after_thinking", tuple(gate))  # normalise a list to a tuple

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

    def _check_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name), f"a number in [-{MAX_PENALTY}, {MAX_PENALTY}]")
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails this too
                raise ValueError(
                    f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}] (0 disables it), got {value}"
                )
            object.__setattr__(self, name, value)
        value = _as_float("repetition_penalty", self.repetition_penalty, "a number > 0")
        if not (math.isfinite(value) and value >= TOP_P_MIN and value <= MAX_TEMPERATURE):
            raise ValueError(
                "repetition_penalty must be a finite number > 0 that float32 holds (1 disables it; above 1"
                f" discourages repeating the prompt's and the output's tokens), got {self.repetition_penalty}"
            )
        object.__setattr__(self, "repetition_penalty", value)
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(bias.items())
        if not isinstance(bias, tuple | list) or not all(
            isinstance(pair, tuple | list) and len(pair) == 2 for pair in bias
        ):
            raise ValueError(f"logit_bias must be (token id, bias) pairs, got {self.logit_bias!r}")
        pairs = []
        for token, amount in bias:
            if not _is_int(token) or not 0 <= token <= INT64_MAX:
                raise ValueError(f"logit_bias token ids must be integers >= 0, got {token!r}")
            value = _as_float(
                "a logit_bias value", amount, f"a number in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"
            )
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {amount!r}"
                )
            pairs.append((token, value))
        if len({token for token, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias names a token id more than once")
        object.__setattr__(self, "logit_bias", tuple(pairs))  # normalised: a tuple of (int, float)
        self._check_masks()

    def _check_masks(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, tuple | list) or not allowed or not all(_is_token(t) for t in allowed):
                raise ValueError(
                    "allowed_token_ids must be a non-empty sequence of token ids (integers >= 0, at most"
                    f" {INT64_MAX}), or None to allow every token; got {allowed!r}"
                )
            if len(set(allowed)) != len(allowed):
                raise ValueError("allowed_token_ids names a token id more than once; list each once")
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))  # normalise a list to a tuple
        words = self.bad_words
        if not isinstance(words, tuple | list) or not all(
            isinstance(word, tuple | list) and word and all(_is_token(t) for t in word) for word in words
        ):
            raise ValueError(
                "bad_words must be a sequence of non-empty token-id sequences (integers >= 0, at most"
                f" {INT64_MAX}: the words already tokenized), got {words!r}"
            )
        object.__setattr__(self, "bad_words", tuple(tuple(word) for word in words))

    @property
    def adjusts_logits(self) -> bool:
        """Whether a bias, a penalty, a mask (``allowed_token_ids``, ``bad_words``) or ``min_tokens``
        changes this request's logits before sampling."""
        return (
            self.min_tokens > 0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
            or self.repetition_penalty != 1.0
            or bool(self.frequency_penalty or self.presence_penalty)
        )

    @property
    def is_greedy(self) -> bool:
        """Whether the token is the argmax (temperature 0); top_k/top_p/seed then do not matter."""
        return self.temperature < GREEDY_TEMPERATURE
