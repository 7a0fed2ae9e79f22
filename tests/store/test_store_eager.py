"""services.store_master.eager: running a handler eagerly agrees with running it as a task."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from services.store_master.eager import run_eager, run_plain


async def at_once(x: int) -> int:
    return x + 1


async def fails_at_once(x: int) -> int:
    raise ValueError(f"bad {x}")


async def waits_then_returns(x: int) -> list[Any]:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    loop.call_soon(fut.set_result, x * 2)
    got = await fut
    await asyncio.sleep(0)  # a bare yield
    await asyncio.sleep(0.01)
    return [x, got, await asyncio.gather(at_once(x), at_once(got))]


async def waits_then_fails(x: int) -> int:
    await asyncio.sleep(0)
    raise KeyError(x)


async def outcome(
    run: Callable[[Coroutine[Any, Any, Any]], Any], coro: Coroutine[Any, Any, Any]
) -> tuple[str, Any]:
    """("now", value) / ("later", value) / ("raised", repr) -- how ``run`` delivered the result."""
    try:
        started = run(coro)
    except Exception as exc:  # noqa: BLE001 - compared below
        return "raised", repr(exc)
    if not isinstance(started, Awaitable):
        return "now", started
    try:
        return "later", await started
    except Exception as exc:  # noqa: BLE001
        return "raised", repr(exc)


@pytest.mark.parametrize("handler", [at_once, fails_at_once, waits_then_returns, waits_then_fails])
async def test_eager_and_plain_give_the_same_results(
    handler: Callable[[int], Coroutine[Any, Any, Any]],
) -> None:
    eager = await outcome(run_eager, handler(3))
    plain = await outcome(run_plain, handler(3))
    assert eager[1] == plain[1] and plain[0] in ("later", "raised")
    assert eager[0] == {"at_once": "now", "waits_then_returns": "later"}.get(handler.__name__, "raised")
    if handler is waits_then_returns:
        assert eager[1] == [3, 6, [4, 7]]


async def test_cancelling_the_rest_cancels_the_handler() -> None:
    seen: list[str] = []

    async def slow() -> int:
        try:
            await asyncio.sleep(30)
        finally:
            seen.append("cleaned up")
        return 1

    rest = run_eager(slow())
    assert isinstance(rest, Coroutine)
    task = asyncio.ensure_future(rest)
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cleaned up"]
