"""The client's staging buffer: a registered region that plain ``put``/``get`` copy through.

Callers take space for a whole batch at once (all or nothing) and wait while it is full, so two
batches never hold half of what each needs. A request bigger than the whole buffer cannot be
served here; the client gives such an object a region of its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from yutu.store.allocator import RangeAllocator
from yutu.transfer import Region, TransferEngine


class Staging:
    def __init__(self, region: Region, alignment: int = 64) -> None:
        self.region = region
        self.allocator = RangeAllocator(region.size, alignment)
        self._freed = asyncio.Condition()

    @property
    def capacity(self) -> int:
        return self.region.size

    def fits(self, sizes: list[int]) -> bool:
        """Whether ``sizes`` could ever be held at once (ignoring what is taken now)."""
        align = self.allocator.alignment
        return sum(-(-s // align) * align for s in sizes) <= self.capacity

    def chunks(self, sizes: list[int]) -> list[list[int]]:
        """Split the indices of ``sizes`` into runs that fit the buffer at once, in order; an object
        bigger than the whole buffer is a run of its own (it gets a temporary region, see Space)."""
        chunks: list[list[int]] = []
        current: list[int] = []
        for i, size in enumerate(sizes):
            if not self.fits([size]):
                chunks.append([i])
                continue
            if not self.fits([sizes[j] for j in current] + [size]):
                chunks.append(current)
                current = []
            current.append(i)
        if current:
            chunks.append(current)
        return chunks

    async def acquire(self, sizes: list[int]) -> list[int]:
        """Offsets for every size, taken together; waits until they fit. Requires ``fits(sizes)``."""
        if not self.fits(sizes):
            raise ValueError(f"{sum(sizes)} bytes never fit a {self.capacity}-byte staging buffer")
        async with self._freed:
            while True:
                offsets: list[int] = []
                for size in sizes:
                    offset = self.allocator.allocate(size)
                    if offset is None:
                        break
                    offsets.append(offset)
                if len(offsets) == len(sizes):
                    return offsets
                for offset in offsets:
                    self.allocator.free(offset)
                await self._freed.wait()

    async def release(self, offsets: list[int]) -> None:
        async with self._freed:
            for offset in offsets:
                self.allocator.free(offset)
            self._freed.notify_all()


class Space:
    """``async with``: staging space for ``sizes``, or a temporary region for one oversized object.

    Yields ``(region, offsets)``; the space is given back on exit.
    """

    def __init__(self, staging: Staging, engine: TransferEngine, sizes: list[int], tmp_name: str) -> None:
        self.staging = staging
        self.engine = engine
        self.sizes = sizes
        self.tmp_name = tmp_name
        self.offsets: list[int] = []
        self.tmp = False

    async def __aenter__(self) -> tuple[Region, list[int]]:
        if self.staging.fits(self.sizes):
            self.offsets = await self.staging.acquire(self.sizes)
            return self.staging.region, self.offsets
        if len(self.sizes) != 1:
            raise ValueError("only a single object may exceed the staging buffer")
        self.tmp = True  # local only: peers never address it, so it needs no publishing
        return self.engine.register_region(self.tmp_name, self.sizes[0]), [0]

    async def __aexit__(self, *exc: Any) -> None:
        if self.tmp:
            self.engine.unregister_region(self.tmp_name)
        elif self.offsets:
            await self.staging.release(self.offsets)
