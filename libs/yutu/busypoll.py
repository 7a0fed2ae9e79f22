"""Bounded busy polling: a caller expecting a reply within microseconds waits for it awake.

A small request over loopback -- a store get's lookup at the master, its 64 KiB read from a store
node -- is answered in tens of microseconds of the peer's work, but a caller that sleeps in the
event loop's ``epoll_wait`` meanwhile pays for being woken (on a virtual machine, most likely
because the idle vCPU halts and the reply has to wake it through the hypervisor). Measured on a
2-vCPU VM (a blocking 100-byte ping-pong between two processes): 85 us a round trip when both
sleep, 29 us when the caller polls its socket instead, 14 us when both do.

So after sending a request the caller yields to its event loop -- ``await asyncio.sleep(0)`` --
until the reply is there or ``budget_s`` has passed, and only then sleeps. Yielding keeps the loop
running other tasks (their callbacks and their sockets are served as usual: a loop with ready
callbacks polls its sockets without blocking), so concurrent calls are not serialised; the
cost is the CPU the poll takes, at most ``budget_s`` a call. With 200 us, a loop of cold 64 KiB
gets over TCP took 340-370 us a get against 450-530 us without, for ~60 us more client CPU a get
(345-367 against 259-327 us); ``loadtests/bench_store.py --spin-us 200`` against ``--spin-us 0``,
three same-hour pairs: the single 64 KiB get at 0.49x, 0.80x and 1.04x Mooncake's against 0.21x,
0.56x and 0.62x.

``budget_s`` 0 is the plain path: sleep at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

SPIN_US = 200  # the default budget of the store client and of TCP transfers run on the event loop


def awake_until(budget_s: float) -> float:
    """The ``time.perf_counter()`` at which a poll budget of ``budget_s`` started now ends."""
    return time.perf_counter() + budget_s


async def poll_once(until: float) -> bool:
    """Yield to the event loop once if the budget ending at ``until`` lasts; False (no yield) once
    it has passed: the caller sleeps instead."""
    if time.perf_counter() >= until:
        return False
    await asyncio.sleep(0)
    return True


async def poll_until(done: Callable[[], bool], budget_s: float) -> None:
    """Yield to the event loop until ``done()`` or ``budget_s`` seconds have passed."""
    if budget_s <= 0:
        return
    until = awake_until(budget_s)
    while not done() and await poll_once(until):
        pass
