"""Garbage-collector pauses: the start-up heap kept out of them, and the ones left measured.

CPython's collector stops the process while it walks the objects of the generations it collects,
and its oldest generation holds everything that survived start-up: imported modules, torch's
and FastAPI's objects, the engine's bookkeeping. Measured on the 2-core machine of the serving
benchmark (Python 3.11, ``loadtests/bench_gc.py``): an engine of the demo model tracks ~287,000
objects once built and a full collection walks them in 147-164 ms; a front end's heap (~226,000
objects) takes 110-139 ms. CPython runs one when enough objects outlived younger collections since
the last: in a minute of load on ``yutu up --prefill 1 --decode 1``, the gateway and the store
master stopped for one each (66-109 ms), in one of two such minutes a prefill worker too (302 ms).
While it walks, a decode instance produces no token for any request it runs, a gateway streams
nothing.

:func:`freeze_startup_heap` collects once and moves every object alive into the permanent
generation (``gc.freeze``), which no collection walks again, as vLLM's engine core and SGLang's
scheduler do after start-up: a full collection then walks only what was made since (well under a
millisecond on an idle engine). Frozen objects are still freed by reference counting; only a
reference cycle among them would never be (start-up objects live as long as the process anyway).
Every service freezes once it has started (``yutu.service.serve``), an engine process once its
model is loaded.

:class:`GcPauses` times every collection of the process (``gc.callbacks``) and hands each pause to
its listeners -- a service's ``/metrics`` histogram (``yutu_gc_pause_seconds``), an engine
process's next message to its worker -- and logs a pause over ``warn_s`` as a warning, so a stall
that clients saw can be told from one the collector caused.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

WARN_S = 0.05  # a pause this long is logged as a warning
# Buckets of the pause histograms: a young collection takes tens of microseconds, a full one over
# an unfrozen heap 25-180 ms on the benchmark machine.
PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 1.0)

Listener = Callable[[int, float], None]  # (generation, pause in seconds)


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze every object alive (see the module
    docstring); returns how many objects are frozen now."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Times this process's collections while installed. ``listeners`` get ``(generation, seconds)``
    after each one; ``clock`` is for tests."""

    def __init__(self, warn_s: float = WARN_S, clock: Callable[[], float] = time.perf_counter) -> None:
        self.warn_s = warn_s
        self._clock = clock
        self.listeners: list[Listener] = []
        self._started: float | None = None

    @property
    def installed(self) -> bool:
        return self._callback in gc.callbacks

    def install(self) -> None:
        if not self.installed:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self.installed:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        if self._started is None:  # installed during a collection
            return
        pause, self._started = self._clock() - self._started, None
        generation = int(info["generation"])
        if pause >= self.warn_s:
            log.warning(
                "garbage collection of generation %d paused this process for %.1f ms (%d objects freed)",
                generation, pause * 1e3, info.get("collected", 0),
            )  # fmt: skip
        for listener in list(self.listeners):
            listener(generation, pause)


_process_pauses: GcPauses | None = None


def process_pauses() -> GcPauses:
    """This process's monitor, installed by every call (``serve`` uninstalls it when its last
    service stops); several services of one process, as in tests, share it: the pauses are the
    process's."""
    global _process_pauses
    if _process_pauses is None:
        _process_pauses = GcPauses()
    _process_pauses.install()
    return _process_pauses
