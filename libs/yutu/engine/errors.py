"""Typed errors of the engine's public API (bad input); internal invariants use ``assert``."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine cannot accept as given (bad token ids, duplicate id, ...)."""


class PromptTooLongError(InvalidRequestError):
    """``len(prompt) + max_tokens`` exceeds the engine's ``max_model_len``."""
