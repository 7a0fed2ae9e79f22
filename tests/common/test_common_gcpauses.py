"""yutu.gcpauses: the start-up heap frozen out of collections, and every collection's pause timed."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator

import pytest
from yutu.gcpauses import GcPauses, freeze_startup_heap


class Node:
    """A tracked container object, to make reference cycles with."""

    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Give the test process's heap back to the collector afterwards."""
    yield
    gc.unfreeze()


def test_frozen_objects_are_out_of_every_walk_until_unfrozen(unfrozen: None) -> None:
    alive = Node()
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector can free
    cycle_ids = {id(a), id(b)}
    del a, b
    gc.disable()  # no collection between here and the freeze but the freeze's own
    try:
        frozen = freeze_startup_heap()
    finally:
        gc.enable()
    assert frozen == gc.get_freeze_count() > 0
    walked = {id(o) for o in gc.get_objects()}
    assert id(alive) not in walked  # frozen: no generation holds it
    assert not cycle_ids & walked  # the garbage before the freeze was collected, not frozen

    c, d = Node(), Node()
    c.other, d.other = d, c
    after_ids = {id(c), id(d)}
    del c, d
    gc.collect()
    assert not after_ids & {id(o) for o in gc.get_objects()}  # objects made after it are collected as ever

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert id(alive) in {id(o) for o in gc.get_objects()}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.step = 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_each_collection_is_timed_by_generation_and_long_ones_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    pauses = GcPauses(warn_s=0.05, clock=clock)
    seen: list[tuple[int, float]] = []
    pauses.listeners.append(lambda generation, seconds: seen.append((generation, seconds)))
    pauses.install()
    pauses.install()  # once only
    try:
        assert gc.callbacks.count(pauses._callback) == 1
        clock.step = 0.01  # the clock moves 10 ms between the start and the stop of a collection
        with caplog.at_level(logging.WARNING, logger="yutu.gcpauses"):
            gc.collect(1)
            assert not caplog.records
            clock.step = 0.2
            gc.collect(2)
    finally:
        pauses.uninstall()
    assert seen == [(1, pytest.approx(0.01)), (2, pytest.approx(0.2))]
    (record,) = caplog.records
    assert "generation 2 paused this process for 200.0 ms" in record.getMessage()
    gc.collect()
    assert len(seen) == 2 and not pauses.installed  # uninstalled: nothing more timed
