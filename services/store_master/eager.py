"""Running a request handler's coroutine eagerly: its first step runs at once, inside the call.

Every handler of the master is a plain ``async def``. Most of them finish without ever waiting
(reads, exists, heartbeats, put_start, anything whose effects need no Redis round trip), so the
server runs the coroutine's first step in place: a coroutine that finishes there gives its reply
at once (the RPC server sends it without making a task); one that suspends comes back as an
awaitable that continues it exactly where it stopped (the server runs that as a task). Python 3.12
does the same with ``asyncio.eager_task_factory``; this is it for one coroutine, on 3.11.

:func:`run_plain` is the reference version (always a task); tests check that the two agree.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


class Started(Awaitable[T]):
    """The rest of a coroutine whose first step already ran and yielded ``first``."""

    def __init__(self, coro: Coroutine[Any, Any, T], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, T]:
        coro, pending = self._coro, self._first
        while True:  # what ``yield from coro`` does, from its second step on
            try:
                sent = yield pending  # hand what the coroutine waits on (a future) to the task
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - cancellation and the like go into it
                try:
                    pending = coro.throw(exc)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
            else:
                try:
                    pending = coro.send(sent)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]


async def _finish(started: Started[T]) -> T:
    return await started


def run_eager(coro: Coroutine[Any, Any, T]) -> T | Coroutine[Any, Any, T]:
    """The coroutine's result if it finishes without waiting, else a coroutine that finishes it.
    An exception raised before the first wait propagates from this call."""
    try:
        first = coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    return _finish(Started(coro, first))


def run_plain(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """The reference: the coroutine as a task (every reply goes through the event loop)."""
    return asyncio.ensure_future(coro)
