"""Batch requests: one outcome per item, in order; a bad item fails alone, never the batch."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from yutu.errors import YutuError
from yutu.protocol import store as p

from services.store_master.state import NoSpaceError

X = TypeVar("X")
T = TypeVar("T")


async def each(
    items: Sequence[X],
    one: Callable[[X], T],
    when_full: Callable[[X], Awaitable[T]] | None = None,
) -> list[p.Outcome[T]]:
    """``one(item)`` per item (a synchronous state operation), its ``YutuError`` as that item's
    failed outcome. An item whose ``one`` raises :class:`NoSpaceError` is given to ``when_full``
    (which makes room and tries again) when there is one. Finishes without suspending unless an
    item needed ``when_full``."""
    results: list[p.Outcome[T]] = []
    for item in items:
        try:
            try:
                value = one(item)
            except NoSpaceError:
                if when_full is None:
                    raise
                value = await when_full(item)
        except YutuError as exc:
            results.append(p.failed(exc.kind, str(exc)))
            continue
        results.append(p.ok(value))
    return results
