"""What one API request may cost: how many choices it asks for, and how many tokens they may generate.

A request's cost on the workers is the tokens its choices may generate: for every (prompt, choice),
the max_tokens it runs with (the request's, else the route's default, else up to the end of the
context). Both limits are refused with a 400 naming the field to change, and checked twice: before
tokenizing, with what the body alone tells (n, the number of prompts, an explicit or default
max_tokens), so an oversized request costs nothing; and after, with the exact max_tokens of each
choice (a chat request without max_tokens may run each choice to the end of the context).

How many of one request's choices run at once (``max_choices_in_flight``) is fairness, not cost:
see generation.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.errors import invalid

# OpenAI's cap on n; 128 choices of 4096 tokens is the most one request may generate by default.
DEFAULT_MAX_N = 128
DEFAULT_MAX_TOTAL_TOKENS = 128 * 4096
DEFAULT_MAX_CHOICES_IN_FLIGHT = 16


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = DEFAULT_MAX_N  # most choices (n) per prompt
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS  # most tokens all choices of a request may generate
    max_choices_in_flight: int = DEFAULT_MAX_CHOICES_IN_FLIGHT  # of one request, running on workers at once

    def __post_init__(self) -> None:
        for name in ("max_n", "max_total_tokens", "max_choices_in_flight"):
            value = getattr(self, name)
            if value < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be at least 1, got {value}")

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise invalid(
                f"n is {n}, but this server allows at most {self.max_n} choices per prompt: lower n"
                " (the gateway's --max-n sets the limit)",
                "n",
            )

    def check_planned(self, num_prompts: int, n: int, max_tokens: int | None, param: str) -> None:
        """Before tokenizing: ``num_prompts * n`` choices of ``max_tokens`` each (None: at least 1)."""
        per_choice = 1 if max_tokens is None else max_tokens
        self._check_total(num_prompts * n * per_choice, max_tokens is not None, num_prompts, n, param)

    def check_generated(self, total: int, num_prompts: int, n: int, param: str) -> None:
        """After tokenizing: ``total`` is the sum of every choice's exact max_tokens."""
        self._check_total(total, True, num_prompts, n, param)

    def _check_total(self, total: int, exact: bool, num_prompts: int, n: int, param: str) -> None:
        if total <= self.max_total_tokens:
            return
        shape = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        amount = f"{total} tokens" if exact else f"at least {total} tokens"
        raise invalid(
            f"this request may generate {amount} ({shape} choices, each up to its {param}), but"
            f" this server allows at most {self.max_total_tokens} per request: set a lower {param}"
            " or n, or send fewer prompts (the gateway's --max-total-tokens sets the limit)",
            param,
        )
