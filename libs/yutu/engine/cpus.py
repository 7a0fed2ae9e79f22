"""How many torch threads a wide engine step takes: the CPUs no other engine is computing on.

A long prompt's chunk (a *wide* step, ``yutu.engine.engine.is_wide``: 256 tokens, or fewer after
a long cached prefix) runs faster on more threads -- on a 2-core CPU a 1,024-token prompt of the demo model takes 1.6x less
time on two threads than on one -- but only on CPUs nothing else computes on. A parallel region
with a thread that shares its CPU waits for that thread at every barrier, and the engine it
shares with (a decode instance's, next to a prefill instance) slows down as well. So before each
wide step the engine counts the threads of the *other engines* of its host that are running now,
and takes the CPUs left, never fewer than its usual threads (``least``) nor more than it is
allowed (``most``)::

    threads = clamp(cpus - threads other engines are running, least, most)

An engine seen running is looked at once more, ``RELOOK_S`` later: one that is handling a command
-- a decode instance admitting a request it was told of early, which happens while that request's
prefill starts -- runs for a few hundred microseconds and waits again, where one that is stepping
runs on. Without the second look, 5, 12 and 26 of 63 sequential 1,024-token prefills on 1P+1D
took one thread in three probe runs (57-71 ms against 32-40 ms on two), the decode instance caught
admitting their requests; with it, 2 and 2 of 63.

Engine processes name themselves ``yutu-engine`` (:func:`name_this_process_an_engine`); the list
of them is read from ``/proc`` every few seconds, and at each wide step the state of their threads
(``/proc/<pid>/task/*/stat``, tens of microseconds). An engine that decodes has its threads
running or runnable (state R) all the time; an idle one waits for commands. Front ends (gateway,
workers' event loops, store) do not count: they have little to do while a wide step computes and
give their CPU back within milliseconds, which is why ``yutu up`` lends their core to wide steps.

The engine binds a short wide step's threads (under 256 tokens: a chunk after a long cached
prefix) one to a CPU while it runs (``wide_step_threads``, ``csrc/threads.cpp``): two threads that
start on the same CPU -- the other one busy at that moment -- otherwise stay together after it
frees, taking turns at every barrier (measured in docs/performance.md, "Threads, wide steps and
step budgets").

What it cannot see: engines in another pid namespace (each container of the compose file runs
one service; cap ``--prefill-threads`` there if engines share CPUs), an engine running on a
thread of its worker (``--engine-core thread``), and work that is not an engine's. Where ``/proc``
cannot be read (not Linux), nothing counts as busy: a wide step takes ``most``.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from collections.abc import Callable

ENGINE_NAME = b"yutu-engine"  # what engine processes call themselves (their comm, at most 15 bytes)
PR_SET_NAME = 15  # prctl(2)
RESCAN_S = 5.0  # how often the list of engine processes is read again
RELOOK_S = 0.0003  # a peer seen running is looked at again this much later (see the module docstring)


def name_this_process_an_engine() -> bool:
    """Name the calling thread, and the threads it starts from now on, ``yutu-engine``, so that the
    wide steps of the host's other engines see it. Call it first thing in the engine process's main
    thread (torch starts its threads later). Returns whether it took (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_NAME, ENGINE_NAME, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def engine_processes(proc: str = "/proc", own: int | None = None) -> list[int]:
    """Pids of the engine processes this pid namespace sees, other than ``own`` (this one)."""
    own = os.getpid() if own is None else own
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    pids = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == own:
            continue
        try:
            with open(f"{proc}/{entry}/comm", "rb") as f:
                if f.read().rstrip(b"\n") == ENGINE_NAME:
                    pids.append(int(entry))
        except OSError:
            continue  # ended meanwhile, or not ours to read
    return pids


def running_threads(pid: int, proc: str = "/proc") -> int | None:
    """Threads of process ``pid`` running or runnable now (state R); None when it is gone."""
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return None
    count = 0
    for tid in tids:
        try:
            with open(f"{proc}/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read(512)
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat.rpartition(b")")[2].split(maxsplit=1)  # after "pid (comm)": the state comes first
        count += bool(fields) and fields[0] == b"R"
    return count


class PeerEngines:
    """The host's other engine processes and how many threads they are running now."""

    def __init__(
        self,
        scan: Callable[[], list[int]] = engine_processes,
        running: Callable[[int], int | None] = running_threads,
        clock: Callable[[], float] = time.monotonic,
        rescan_s: float = RESCAN_S,
    ) -> None:
        self._scan, self._running, self._clock, self._rescan_s = scan, running, clock, rescan_s
        self.pids: list[int] = []
        self._scanned_at = -math.inf

    def busy(self) -> int:
        """Threads the other engines are running now (the list is read again every ``rescan_s``,
        and at once after one of them ended)."""
        now = self._clock()
        if now - self._scanned_at >= self._rescan_s:
            self.pids, self._scanned_at = self._scan(), now
        total = 0
        for pid in self.pids:
            running = self._running(pid)
            if running is None:  # ended (a restarted instance has a new pid): read the list anew
                self._scanned_at = -math.inf
            else:
                total += running
        return total


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class WideStepThreads:
    """Picks a wide step's threads: the CPUs no other engine computes on, at most ``most`` (see the
    module docstring). ``busy`` counts the threads other engines are running (tests pass their own)."""

    def __init__(
        self,
        most: int,
        cpus: int | None = None,
        busy: Callable[[], int] | None = None,
        relook_s: float = RELOOK_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if most < 1:
            raise ValueError(f"a wide step needs at least one thread, got most={most}")
        self.most = most
        self.cpus = cpus or usable_cpus()
        self._busy = busy or PeerEngines().busy
        self._relook_s, self._sleep = relook_s, sleep

    def pick(self, least: int) -> int:
        """Threads for a wide step starting now, never fewer than ``least`` (the usual threads)."""
        if self.most <= least:
            return least
        busy = self._busy()
        if busy and self._relook_s > 0 and self.cpus - busy < self.most:  # a peer handling a command?
            self._sleep(self._relook_s)
            busy = min(busy, self._busy())
        return max(least, min(self.most, self.cpus - busy))
