"""The engine process's stream: commands' frames cut right however the bytes arrive, Stop at EOF;
events carrying the garbage collector's pauses."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from yutu.engine.engine import EngineConfig
from yutu.worker.kv_region import KVRegion

from services.worker.engine_core import Abort, FinishLoad, LoadState, Stop
from services.worker.engine_process import (
    FRAME,
    EngineProcess,
    _SocketEvents,
    _StreamCommands,
    sweep_stale_socket_dirs,
)


def frame(message: object) -> bytes:
    payload = pickle.dumps(message)
    return FRAME.pack(len(payload)) + payload


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, _StreamCommands]]:
    worker, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield worker, _StreamCommands(child)
    worker.close()
    child.close()


def test_nothing_sent_is_none_without_waiting(pair: tuple[socket.socket, _StreamCommands]) -> None:
    _, commands = pair
    started = time.monotonic()
    assert commands.get_nowait() is None
    assert time.monotonic() - started < 0.5


def test_frames_in_one_write_and_split_across_writes(pair: tuple[socket.socket, _StreamCommands]) -> None:
    worker, commands = pair
    sent = [Abort(f"r{i}") for i in range(50)] + [FinishLoad("big", 10**6)]
    data = b"".join(frame(m) for m in sent)
    worker.sendall(data[:7])  # less than a frame header and its body
    assert commands.get_nowait() is None
    worker.sendall(data[7:])
    got = []
    while (command := commands.get_nowait()) is not None:
        got.append(command)
    assert got == sent


def test_get_waits_for_a_command_sent_later(pair: tuple[socket.socket, _StreamCommands]) -> None:
    worker, commands = pair
    data = frame(Abort("late"))

    def send_in_two_parts() -> None:
        time.sleep(0.1)
        worker.sendall(data[:3])
        time.sleep(0.05)
        worker.sendall(data[3:])

    sender = threading.Thread(target=send_in_two_parts)
    sender.start()
    try:
        assert commands.get() == Abort("late")
    finally:
        sender.join()


def test_the_worker_closing_its_end_reads_as_stop(pair: tuple[socket.socket, _StreamCommands]) -> None:
    worker, commands = pair
    worker.sendall(frame(Abort("last")))
    worker.close()
    assert commands.get() == Abort("last")  # what it sent before closing comes first
    assert isinstance(commands.get(), Stop)
    assert isinstance(commands.get_nowait(), Stop)


def test_start_up_replies_are_read_the_same_way(pair: tuple[socket.socket, _StreamCommands]) -> None:
    worker, commands = pair
    worker.sendall(frame(("region", "/dev/shm/x", 4096, 7)))
    assert commands.reply() == ("region", "/dev/shm/x", 4096, 7)


def test_commands_to_an_engine_process_without_a_stream_are_dropped_not_raised(tmp_path: Path) -> None:
    # Not started (or stopped, or its process gone): the worker's cleanup still calls abort,
    # finish_load, unpin; they must not raise into it.
    region = KVRegion(None)  # type: ignore[arg-type]  # never registered: no child asks for it
    process = EngineProcess(
        EngineConfig(model_dir=tmp_path), region, lambda outputs: None, lambda rid, exc: None
    )
    try:
        process.abort("r1")
        process.finish_load("r1", 16)
        process.unpin([1, 2])
    finally:
        asyncio.run(process.stop())  # removes its socket folder


def test_socket_folders_of_gone_workers_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    dead_pid = int(gone.stdout)
    dead = tmp_path / f"yutu-engine-{dead_pid}-abc"
    live = tmp_path / f"yutu-engine-{os.getpid()}-def"
    other = tmp_path / "yutu-engine-notapid"
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "engine.sock").write_bytes(b"")
    assert sweep_stale_socket_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and other.exists()


def test_the_engine_process_sends_its_pauses_with_its_next_message(tmp_path: Path) -> None:
    """Never from the collector's callback (it may run in the middle of a send): they ride with the
    next step's message, and the worker hands them to ``on_gc_pause``."""
    worker, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sink = _SocketEvents(child, LoadState())
        sink.gc_paused(0, 0.0001)
        sink.gc_paused(2, 0.15)
        sink.outputs([], stats=None)  # type: ignore[arg-type]
        sink.outputs([], stats=None)  # type: ignore[arg-type]
        messages = []
        for _ in range(2):
            (length,) = FRAME.unpack(worker.recv(FRAME.size, socket.MSG_WAITALL))
            messages.append(pickle.loads(worker.recv(length, socket.MSG_WAITALL)))
    finally:
        worker.close()
        child.close()
    assert [m[0] for m in messages] == ["out", "out"]
    assert messages[0][-1] == [(0, 0.0001), (2, 0.15)]
    assert messages[1][-1] == []  # sent once

    # The worker's side: each pause of an "out" or "load" message goes to on_gc_pause.
    got: list[tuple[int, float]] = []
    region = KVRegion(None)  # type: ignore[arg-type]  # never started: only its dispatch runs here
    process = EngineProcess(
        EngineConfig(model_dir=tmp_path), region, lambda outputs: None, lambda rid, exc: None,
        on_gc_pause=lambda generation, seconds: got.append((generation, seconds)),
    )  # fmt: skip
    try:
        process._dispatch(("load", None, [], [], None, [(1, 0.002)]))
        process._dispatch(messages[0])  # a step that produced no tokens, and two pauses
    finally:
        asyncio.run(process.stop())
    assert got == [(1, 0.002), (0, 0.0001), (2, 0.15)]
