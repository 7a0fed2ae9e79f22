"""RangeAllocator: exact offsets, best fit, coalescing, reserve, integrity."""

from __future__ import annotations

import random

import pytest
from yutu.store.allocator import AllocatorError, RangeAllocator


def test_best_fit_and_exact_offsets() -> None:
    a = RangeAllocator(1024, alignment=64)
    assert a.allocate(100) == 0  # [0,128)
    assert a.allocate(64) == 128  # [128,192)
    assert a.allocate(1) == 192  # [192,256)
    assert a.used_bytes == 256
    assert a.free(0) == 128  # hole [0,128), tail [256,1024)
    assert a.allocate(64) == 0  # best fit picks the 128-byte hole, not the 768-byte tail
    assert a.allocate(64) == 64  # the rest of the hole
    assert a.allocate(64) == 256  # then the tail
    a.check()


def test_free_coalesces_both_neighbours() -> None:
    a = RangeAllocator(640, alignment=64)
    offsets = [a.allocate(64) for _ in range(10)]
    assert offsets == [0, 64, 128, 192, 256, 320, 384, 448, 512, 576]
    assert a.allocate(1) is None  # full
    a.free(128)
    a.free(256)
    assert a.free_ranges() == [(128, 64), (256, 64)]
    assert a.fragmentation == pytest.approx(0.5)
    a.free(192)  # joins [128,192) and [256,320)
    assert a.free_ranges() == [(128, 192)]
    assert a.fragmentation == 0.0
    assert a.allocate(192) == 128
    a.check()


def test_none_when_nothing_fits_despite_free_bytes() -> None:
    a = RangeAllocator(256, alignment=64)
    offs = [a.allocate(64) for _ in range(4)]
    a.free(offs[0])
    a.free(offs[2])
    assert a.free_bytes == 128
    assert a.largest_free == 64
    assert not a.can_allocate(128)
    assert a.allocate(128) is None


def test_reserve_splits_a_free_range_and_refuses_overlap() -> None:
    a = RangeAllocator(1024, alignment=64)
    a.reserve(256, 100)  # [256,384)
    assert a.free_ranges() == [(0, 256), (384, 640)]
    with pytest.raises(AllocatorError):
        a.reserve(320, 64)
    with pytest.raises(AllocatorError):
        a.reserve(30, 64)  # unaligned
    assert a.allocate(256) == 0
    a.check()


def test_bad_frees_are_refused() -> None:
    a = RangeAllocator(256)
    off = a.allocate(10)
    assert off is not None
    with pytest.raises(AllocatorError):
        a.free(off + 64)
    a.free(off)
    with pytest.raises(AllocatorError):
        a.free(off)
    with pytest.raises(AllocatorError):
        a.allocate(0)


def test_random_workload_keeps_invariants() -> None:
    rng = random.Random(7)
    a = RangeAllocator(1 << 20, alignment=64)
    live: list[int] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            off = a.allocate(rng.randint(1, 20000))
            if off is not None:
                live.append(off)
    a.check()
    for off in live:
        a.free(off)
    a.check()
    assert a.free_ranges() == [(0, 1 << 20)]
