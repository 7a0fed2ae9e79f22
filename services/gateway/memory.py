"""Giving memory back to the OS after large requests.

A large request body (its bytes, the decoded JSON string, the validated copy) and a large
tokenization (the tokenizer's intermediate buffers, the Encoding) are freed when the request ends,
but glibc keeps freed memory in its heaps: the main arena grows with ``brk`` once the dynamic mmap
threshold has risen past the size of a freed block, and each tokenizer thread allocates from an
arena of its own. Without help the gateway's RSS stays at its high-water mark (measured on main:
76 MiB to 1.45 GB after four 10 MB prompts, and kept). ``malloc_trim(0)`` returns the free pages of
every arena; it is called off the event loop, after each large request, by one supervised loop
(:class:`MemoryReleaser`) so that bursts coalesce into one trim.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from functools import lru_cache

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

LARGE_REQUEST_BYTES = 1 << 20  # bodies (and tokenized texts, in characters) from this size trigger a trim


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (VmRSS in /proc/<pid>/status); 0 where /proc has none."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@lru_cache(maxsize=1)
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim  # glibc only; ctypes releases the GIL during the call
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_memory() -> bool:
    """Return free heap pages of every malloc arena to the OS; False where libc has no malloc_trim."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class MemoryReleaser:
    """Trims the heap off the event loop, once per burst of :meth:`soon` calls."""

    def __init__(self) -> None:
        self._wanted = asyncio.Event()
        self.trims = 0  # how many trims ran (for tests and /info)

    def soon(self) -> None:
        """Ask for a trim after the current work; cheap, callable from the event loop only."""
        self._wanted.set()

    async def run(self) -> None:
        """The loop: wait for a request, trim in a thread, repeat (run it under the Supervisor)."""
        while True:
            await self._wanted.wait()
            self._wanted.clear()  # calls from now on ask for the next trim
            if not await asyncio.to_thread(release_memory):
                log.info("malloc_trim is not available (not glibc): freed memory stays with the process")
                return
            self.trims += 1


class ReleaseAfterLargeBodies:
    """ASGI middleware: once a request whose body had LARGE_REQUEST_BYTES or more ends, ask for a trim."""

    def __init__(self, app: ASGIApp, releaser: MemoryReleaser) -> None:
        self.app = app
        self.releaser = releaser

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if received >= LARGE_REQUEST_BYTES:
                self.releaser.soon()
