"""Typed errors of the engine's public API; internal invariants use ``assert``.

Bad input is a ValueError (the caller must change the request). A request the engine accepted and
then had to give up on is a :class:`RequestFailedError`; an engine that cannot go on raises
:class:`EngineBrokenError`. Both carry an :class:`~yutu.errors.ErrorKind` so services answer them
with the right status.
"""

from __future__ import annotations

from yutu.errors import ErrorKind, YutuError


class InvalidRequestError(ValueError):
    """A request the engine cannot accept as given (bad token ids, duplicate id, ...)."""


class PromptTooLongError(InvalidRequestError):
    """``len(prompt) + max_tokens`` exceeds the engine's ``max_model_len``."""


class RequestFailedError(YutuError):
    """The engine failed a request it had accepted (its step raised, or the model's logits for it were
    not finite). The request was aborted and its blocks freed; it is not the caller's fault."""

    kind = ErrorKind.INTERNAL


class EngineBrokenError(YutuError):
    """The engine cannot serve any more (e.g. its block pool is inconsistent after a failed step, or
    steps keep failing). Stop sending it work; the message says why."""

    kind = ErrorKind.UNAVAILABLE
