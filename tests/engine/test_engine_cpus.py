"""yutu.engine.cpus: the host's other engines, what they run, and the threads a wide step takes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from yutu.engine.cpus import (
    ENGINE_NAME,
    RELOOK_S,
    PeerEngines,
    WideStepThreads,
    engine_processes,
    running_threads,
)

LINUX = Path("/proc/self/comm").is_file()


def _fake_proc(root: Path, processes: dict[int, tuple[bytes, list[str]]]) -> str:
    """A /proc with ``pid -> (comm, thread states)``."""
    for pid, (comm, states) in processes.items():
        (root / str(pid) / "task").mkdir(parents=True)
        (root / str(pid) / "comm").write_bytes(comm + b"\n")
        for i, state in enumerate(states):
            (root / str(pid) / "task" / str(pid + i)).mkdir()
            (root / str(pid) / "task" / str(pid + i) / "stat").write_text(
                f"{pid + i} (a (b) c) {state} 1 2\n"
            )
    (root / "self").mkdir()
    (root / "loadavg").write_text("0.1 0.2 0.3 1/99 123\n")
    return str(root)


def test_engines_are_found_by_name_and_their_running_threads_counted(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path,
        {
            10: (ENGINE_NAME, ["R", "S"]),  # an engine decoding on one thread
            11: (ENGINE_NAME, ["S"]),  # an idle engine
            12: (b"python", ["R", "R"]),  # a front end: not an engine
            13: (ENGINE_NAME, ["R", "R"]),  # this process
        },
    )
    assert sorted(engine_processes(proc, own=13)) == [10, 11]
    assert [running_threads(pid, proc) for pid in (10, 11, 12)] == [1, 0, 2]
    assert running_threads(99, proc) is None  # gone


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_peers_are_read_again_every_few_seconds_and_at_once_when_one_ended() -> None:
    scans: list[list[int]] = [[1, 2], [2, 3], [3]]
    running = {1: 1, 2: 0, 3: 2}
    clock = Clock()
    peers = PeerEngines(scan=lambda: scans.pop(0), running=running.get, clock=clock, rescan_s=5.0)
    assert peers.busy() == 1 and peers.pids == [1, 2]
    clock.now += 4.0
    assert peers.busy() == 1 and peers.pids == [1, 2]  # not read again yet
    del running[1]  # pid 1 ended: counted as nothing now, and the list is read at the next step
    assert peers.busy() == 0
    assert peers.busy() == 2 and peers.pids == [2, 3]
    clock.now += 5.0
    assert peers.busy() == 2 and peers.pids == [3]


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_a_real_engine_process_counts_while_it_computes_and_not_while_it_waits() -> None:
    """Child processes named as engines: one computing (as an engine decodes), one sleeping (as an
    idle engine waits for commands); a third computes under another name (a front end)."""
    name = "from yutu.engine.cpus import name_this_process_an_engine as n; assert n(); "
    children = [
        subprocess.Popen([sys.executable, "-c", name + "\nwhile True: pass"]),
        subprocess.Popen([sys.executable, "-c", name + "import time; time.sleep(60)"]),
        subprocess.Popen([sys.executable, "-c", "while True: pass"]),
    ]
    busy, idle, other = (c.pid for c in children)
    try:
        deadline = time.monotonic() + 10
        while not {busy, idle} <= set(engine_processes()) and time.monotonic() < deadline:
            time.sleep(0.02)  # until both have named themselves
        engines = engine_processes()
        assert {busy, idle} <= set(engines) and other not in engines
        assert running_threads(idle) == 0
        counts = [running_threads(busy) for _ in range(20)]  # runnable even while waiting for a CPU
        assert sum(c == 1 for c in counts if c is not None) >= 18, counts
        assert WideStepThreads(most=2, cpus=2).pick(1) == 1  # the other CPU is an engine's
    finally:
        for child in children:
            child.kill()
            child.wait()


@pytest.mark.parametrize(
    ("most", "cpus", "busy", "least", "threads"),
    [
        (2, 2, 0, 1, 2),  # 1P+1D on 2 cores, the decode idle: the prefill takes both
        (2, 2, 1, 1, 1),  # the decode stepping: the prefill keeps to one
        (2, 2, 5, 1, 1),  # never fewer than the usual threads
        (8, 16, 3, 2, 8),  # never more than allowed
        (8, 16, 12, 2, 4),
        (1, 4, 0, 1, 1),  # nothing to choose: nothing read
        (2, 4, 0, 3, 3),  # the usual threads exceed the most: the usual
    ],
)
def test_a_wide_step_takes_the_cpus_no_other_engine_computes_on(
    most: int, cpus: int, busy: int, least: int, threads: int
) -> None:
    readings: list[int] = []

    def count() -> int:
        readings.append(busy)
        return busy

    slept: list[float] = []
    assert WideStepThreads(most, cpus, busy=count, sleep=slept.append).pick(least) == threads
    looked_again = most > least and 0 < busy and cpus - busy < most  # a busy peer costs threads
    assert len(readings) == (0 if most <= least else 2 if looked_again else 1)
    assert slept == ([RELOOK_S] if looked_again else [])


@pytest.mark.parametrize(
    ("looks", "threads"),
    [
        ([1, 0], 2),  # the decode was admitting a request it was told of: it waits again, both CPUs
        ([1, 1], 1),  # the decode is stepping: one
        ([2, 1], 1),  # the fewer of the two looks
    ],
)
def test_a_peer_seen_running_is_looked_at_again_before_it_costs_threads(
    looks: list[int], threads: int
) -> None:
    slept: list[float] = []
    picker = WideStepThreads(most=2, cpus=2, busy=lambda: looks.pop(0), sleep=slept.append)
    assert picker.pick(1) == threads and looks == [] and slept == [RELOOK_S]


def test_at_least_one_thread() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        WideStepThreads(0)
