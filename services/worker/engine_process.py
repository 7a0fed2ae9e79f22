"""The engine core in a process of its own (the default; ``--engine-core process``).

The worker's event loop and an engine *thread* share one GIL: every microsecond of Python the
loop spends per token (framing, sending, bookkeeping) is taken from the model step, and a send
on the loop waits for the engine thread to let the GIL go (measured: ~0.3 ms per token at batch
1). As vLLM V1 keeps its EngineCore in its own process, the worker starts one child process that
runs :class:`~services.worker.engine_core.EngineCore` -- the same code the thread front runs --
and keeps its sockets, transfer engine, store client and HTTP app in the worker process::

    worker process (event loop)                       engine process (spawned)
    EngineProcess.add()/abort()/...  -- Unix stream -->  commands -> EngineCore.serve()
    callbacks on the loop            <-- (same one) --  one message per step: tokens + stats
                                                        (+ measurements), errors, loads, cache

Both ways go over one plain Unix stream socket (length-prefixed pickles), so neither a command
nor a step's message crosses a ZeroMQ I/O thread on either side: the engine loop writes events
with ``sendall`` and reads commands between steps (blocking on the socket only when it has
nothing to step), the worker's event loop reads events as a protocol and writes commands through
its transport, which never blocks. Measured for events (a 2 KB message, a synchronous sender, a
uvloop receiver): 21 us of receiver CPU and 41 us of sender CPU a message against 89-103 us and
58-70 us over ZeroMQ ipc PUSH/PULL, on a 2-core machine where that CPU is taken from the other
processes of the stack. Events are bounded (the kernel's buffer): a worker whose loop stops
reading holds the engine at its next send rather than letting the queue grow without bound.
Commands are few and small and are queued in the worker's transport while the engine steps.

The KV cache stays in the worker's registered region: the child asks for a region of the shape
its memory budget gives, the worker registers it with its transfer engine and answers with the
file, and the child maps that file, so peers read and write blocks the model uses without a copy.
Messages are pickled (same Python, same code on both ends). The child ignores SIGINT and SIGTERM
(the worker decides when to stop, after draining), dies with the worker (PR_SET_PDEATHSIG
SIGKILL), and if it dies on its own
the engine is *broken* (``broken`` says how it ended), exactly as when the thread's engine breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import mmap
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import tempfile
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from yutu.engine.engine import EngineConfig, EngineStats, KVLoad, RequestOutput
from yutu.errors import ErrorKind, YutuError
from yutu.gcpauses import Listener, freeze_startup_heap, process_pauses
from yutu.kv.block_manager import CacheEvent
from yutu.supervise import cancel_and_wait
from yutu.transfer.region import pid_alive
from yutu.worker.kv_region import KVRegion

from services.worker.engine_core import (
    MAX_FAILED_STEPS,
    Command,
    EngineInfo,
    LoadState,
    Stop,
)
from services.worker.engine_loop import EngineFront, OnCache, OnError, OnLoads, OnOutputs

log = logging.getLogger(__name__)
T = TypeVar("T")

START_TIMEOUT_S = 600.0  # loading a model can take long; a child that died is noticed at once
STOP_TIMEOUT_S = 10.0  # after this the child is killed
EOF_WAIT_S = 1.0  # a child that ended: how long its last events may take to arrive before it is called broken
FRAME = struct.Struct("<I")  # a message (event or command): its pickled length, then the pickle
STREAM_BUFFER = 4 << 20  # kernel buffer of the event stream, each way


class EngineProcessError(YutuError):
    """The engine process could not start or ended on its own."""

    kind = ErrorKind.UNAVAILABLE


@dataclass(frozen=True)
class ChildArgs:
    config: EngineConfig  # without kv_cache_factory: the child maps the worker's region
    stream: str  # path of the Unix stream socket the child connects to: events out, commands in
    parent_pid: int
    torch_threads: int  # 0: torch's default
    max_failed_steps: int
    record_cache: bool
    pin_stored: bool
    log_level: str
    log_format: str


def _dumps(message: object) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


async def _raised(failed: asyncio.Future[None]) -> None:
    await failed  # raises what dispatching an event raised; never returns otherwise


class _EventStream(asyncio.Protocol):
    """The worker's end of the event stream: cuts it into messages, hands each to ``on_message``
    in order; ``on_eof`` once the child's end closed (after every message it wrote)."""

    def __init__(self, on_message: Any, on_eof: Any, failed: asyncio.Future[None]) -> None:
        self._buf = bytearray()
        self._on_message, self._on_eof, self._failed = on_message, on_eof, failed

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        try:
            while len(buf) - pos >= FRAME.size:
                (length,) = FRAME.unpack_from(buf, pos)
                end = pos + FRAME.size + length
                if len(buf) < end:
                    break
                message = pickle.loads(buf[pos + FRAME.size : end])  # a copy: buf is cut below
                pos = end
                self._on_message(message)
        except BaseException as exc:  # a dispatch bug: the supervised task reports it
            if not self._failed.done():
                self._failed.set_exception(exc)
            raise
        finally:
            del buf[:pos]

    def eof_received(self) -> bool:
        return False  # close our end too

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_eof()


class EngineProcess(EngineFront):
    """Owns the engine process; all methods are called from the event loop."""

    def __init__(
        self,
        config: EngineConfig,
        region: KVRegion,
        on_outputs: OnOutputs,
        on_error: OnError,
        max_failed_steps: int = MAX_FAILED_STEPS,
        *,
        on_loads: OnLoads | None = None,
        on_cache: OnCache | None = None,
        pin_stored: bool = False,
        torch_threads: int = 0,
        log_settings: tuple[str, str] = ("info", "text"),
        on_gc_pause: Listener | None = None,
    ) -> None:
        """``log_settings``: (level, format) the child logs with (see ``yutu.logs``).
        ``on_gc_pause(generation, seconds)``: each garbage collection of the child, as it reports
        them (with its next step's message)."""
        super().__init__(on_outputs, on_error, on_loads=on_loads, on_cache=on_cache)
        self._region = region
        self._on_gc_pause = on_gc_pause
        sweep_stale_socket_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        path = os.path.join(self._dir, "engine.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(1)
        self._listener.setblocking(False)
        self._args = ChildArgs(
            dataclasses.replace(config, kv_cache_factory=None), path, os.getpid(),
            torch_threads, max_failed_steps, on_cache is not None, pin_stored, *log_settings,
        )  # fmt: skip
        self._process: Any = None  # multiprocessing's SpawnProcess
        self._stream: asyncio.WriteTransport | None = None
        self._inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()  # events until the child is ready
        self._deliver: Any = self._inbox.put_nowait  # then each event is dispatched as it arrives
        self._eof = False  # the child's end of the stream closed (every event it sent has arrived)
        self._ended_seen = False  # its process ended (the sentinel fired)
        self._stopping = False
        # Supervised while the engine runs: fails if dispatching an event raised.
        self.task: asyncio.Task[None] | None = None
        self.info: EngineInfo | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:  # noqa: ASYNC109 - one wait, named
        """Start the child, register its KV region, wait until its engine is loaded. Raises
        EngineProcessError (or the engine's own error, e.g. a ValueError for a bad config)."""
        self._process = multiprocessing.get_context("spawn").Process(
            target=child_main, args=(self._args,), name="yutu-engine", daemon=True
        )
        # libgomp reads this as torch loads, which happens while the child unpickles its arguments.
        os.environ.setdefault("GOMP_SPINCOUNT", str(OMP_SPIN_COUNT))
        self._process.start()
        log.info("engine process %d starting", self._process.pid)
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[None] = loop.create_future()
        try:
            await asyncio.wait_for(self._connect(failed), timeout_s)
            await asyncio.wait_for(self._handshake(), timeout_s)
        except BaseException:
            await self._end_child()
            raise
        self.task = asyncio.ensure_future(_raised(failed))
        while not self._inbox.empty():  # what came after "ready", in order, then straight through
            self._dispatch(self._inbox.get_nowait())
        self._deliver = self._dispatch
        loop.add_reader(self._process.sentinel, self._child_ended)

    async def _connect(self, failed: asyncio.Future[None]) -> None:
        """Accept the child's event stream (or raise when the child ended first)."""
        loop = asyncio.get_running_loop()
        conn, _ = await self._unless_ended(loop.sock_accept(self._listener))
        self._listener.close()
        _remove_socket_dir(self._dir)  # connected: the path has done its job
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STREAM_BUFFER)
        self._stream, _ = await loop.connect_accepted_socket(
            lambda: _EventStream(lambda message: self._deliver(message), self._on_eof, failed), conn
        )

    async def _handshake(self) -> None:
        while True:
            message = await self._next_event()
            tag = message[0]
            if tag == "region":
                _, shape, dtype_name = message
                region = self._region.register(tuple(shape), dtype_name)
                self._send_raw(("region", region.path, region.size, region.inode))
            elif tag == "ready":
                _, self.info, self.stats = message
                log.info("engine process %d ready", self._process.pid)
                return
            elif tag == "failed":
                raise message[1]
            else:
                raise EngineProcessError(f"engine process sent {tag!r} before it was ready")

    async def _next_event(self) -> tuple[Any, ...]:
        """The child's next message; raises EngineProcessError when the child ended instead."""
        return await self._unless_ended(self._inbox.get())

    async def _unless_ended(self, waited: Awaitable[T]) -> T:
        """What ``waited`` gives, or EngineProcessError if the child process ends first (start-up)."""
        result = asyncio.ensure_future(waited)
        ended = asyncio.ensure_future(self._ended())
        try:
            done, _ = await asyncio.wait({result, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if result in done:
            return result.result()
        result.cancel()
        raise EngineProcessError(f"the engine process ended during start-up ({self._exit_status()})")

    async def _ended(self) -> None:
        """Returns when the child process has ended."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        sentinel = self._process.sentinel
        loop.add_reader(sentinel, lambda: None if ended.done() else ended.set_result(None))
        try:
            await ended
        finally:
            loop.remove_reader(sentinel)

    def _exit_status(self) -> str:
        code = self._process.exitcode if self._process is not None else None
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    async def stop(self) -> None:
        """Stop the core (it finishes the step it is in), then the process; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self._process is not None and self._process.is_alive() and self._stream is not None:
            self._send(Stop())
        await self._end_child()
        if self.task is not None:
            await cancel_and_wait([self.task], "engine process client")
        if self._process is not None:
            with contextlib.suppress(ValueError, OSError):  # already removed when it ended first
                asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self._stream is not None:
            self._stream.close()
        self._listener.close()
        _remove_socket_dir(self._dir)

    async def _end_child(self) -> None:
        process = self._process
        if process is None:
            return
        self._stopping = True
        await asyncio.to_thread(process.join, STOP_TIMEOUT_S)
        if process.is_alive():
            log.warning("engine process %d did not stop in %.0f s: killing it", process.pid, STOP_TIMEOUT_S)
            process.kill()
            await asyncio.to_thread(process.join)

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # -- commands and events ---------------------------------------------------------------------

    def _send(self, command: Command) -> None:
        self._send_raw(command)

    def _send_raw(self, message: object) -> None:
        # The transport buffers what the socket does not take at once: this never blocks the loop.
        if self._stream is None or self._stream.is_closing():
            # Not started, stopping, or the process is gone (``broken`` says so, and new requests
            # are failed before they get here): nothing reads commands any more. An abort, a
            # finish_load or an unpin from the worker's cleanup must not raise into its caller.
            log.debug("engine process stream closed: dropping %s", type(message).__name__)
            return
        payload = _dumps(message)
        self._stream.write(FRAME.pack(len(payload)) + payload)

    def _fail_soon(self, request_id: str, exc: BaseException) -> None:
        asyncio.get_running_loop().call_soon(self._on_error, request_id, exc)

    def _child_ended(self) -> None:
        """The child process ended: unless we are stopping it, the engine is broken -- once the
        events it sent before it ended (say, why it broke) have arrived: they come first."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._process.sentinel)
        self._ended_seen = True
        if self._stopping:
            return
        if self._eof:
            self._break()
        else:
            loop.call_later(EOF_WAIT_S, self._break)

    def _on_eof(self) -> None:
        self._eof = True
        if self._ended_seen:
            self._break()

    def _break(self) -> None:
        if self._stopping or self.failure is not None:
            return
        self._process.join(1.0)  # it has ended (its sentinel says so): this reaps it for its status
        if self.task is not None:
            self.task.cancel()
        reason = f"the engine process ended ({self._exit_status()})"
        log.error("%s", reason)
        exc = EngineProcessError(reason)
        self.failure = exc
        self._event_broken(reason, exc)

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        tag = message[0]
        if tag == "out":
            _, outputs, stats, steps, prefills, queue, pauses = message
            self._measured(steps, prefills, queue, pauses)
            self._event_outputs(outputs, stats)
        elif tag == "error":
            _, request_id, kind, text = message
            self._on_error(request_id, YutuError(text, ErrorKind(kind)) if kind else ValueError(text))
        elif tag == "loads":
            assert self._on_loads is not None, "a request imports KV but nobody copies it"
            self._on_loads(message[1])
        elif tag == "cache":
            assert self._on_cache is not None
            self._on_cache(message[1], message[2])
        elif tag == "load":
            _, stats, steps, prefills, queue, pauses = message
            self.stats = stats
            self._measured(steps, prefills, queue, pauses)
        elif tag == "check":
            self._event_check(message[1], message[2])
        elif tag == "broken":
            _, reason, kind, text = message
            self._event_broken(reason, YutuError(text, ErrorKind(kind)) if kind else RuntimeError(text))
        else:
            log.warning("engine process sent an unknown message %r", tag)

    def _measured(
        self,
        steps: list[list[float]],
        prefills: list[list[float]],
        queue: tuple[list[list[Any]], list[list[int]]] | None,
        gc_pauses: list[tuple[int, float]],
    ) -> None:
        self.load.steps.extend(steps)
        self.load.prefills.extend(prefills)
        if queue is not None:
            self.load.queued, self.load.decoding = queue
        if self._on_gc_pause is not None:
            for generation, seconds in gc_pauses:
                self._on_gc_pause(generation, seconds)


SOCKET_DIR_PREFIX = "yutu-engine-"  # + the worker's pid + "-" + random: the engine socket's folder


def sweep_stale_socket_dirs(directory: str | None = None) -> list[str]:
    """Remove the engine-socket folders of workers that are gone (one SIGKILLed before its engine
    connected leaves its folder); return their paths. The worker's pid is in the name; a live
    worker's folder is never touched (pids are judged in our pid namespace, like region files)."""
    directory = directory or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            if not entry.startswith(SOCKET_DIR_PREFIX):
                continue
            pid = entry.removeprefix(SOCKET_DIR_PREFIX).partition("-")[0]
            path = os.path.join(directory, entry)
            if pid.isdigit() and not pid_alive(int(pid)) and _remove_socket_dir(path):
                removed.append(path)
    if removed:
        log.info("removed %d engine socket folder(s) of workers that are gone", len(removed))
    return removed


def _remove_socket_dir(path: str) -> bool:
    """Remove a folder holding only an engine socket; False when not there or not only that."""
    try:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)
    except OSError:
        return False
    return True


# -- the child -----------------------------------------------------------------------------------


def _error_parts(exc: BaseException) -> tuple[str, str]:
    """(kind, message) of an error to rebuild on the worker's side: kind "" for a ValueError."""
    if isinstance(exc, YutuError):
        return exc.kind.value, str(exc)
    if isinstance(exc, ValueError):  # bad input (PromptTooLongError among them): the caller's to change
        return "", str(exc)
    return ErrorKind.INTERNAL.value, f"{type(exc).__name__}: {exc}"


class _StreamCommands:
    """The child's end of the stream, read for commands (the same socket carries its events out).

    The worker's end closing (it died: PR_SET_PDEATHSIG kills us anyway) reads as ``Stop``.
    """

    def __init__(self, stream: socket.socket) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._closed = False

    def get(self) -> Command:
        """The next command, waiting for one."""
        command: Command = self._wait()
        return command

    def get_nowait(self) -> Command | None:
        message = self._next()
        if message is None:
            self._receive(socket.MSG_DONTWAIT)
            message = self._next()
        command: Command | None = message
        return command

    def _next(self) -> Any:
        """The first whole message in the buffer (removed from it), Stop once closed, else None."""
        buf = self._buf
        if len(buf) >= FRAME.size:
            (length,) = FRAME.unpack_from(buf)
            if len(buf) >= FRAME.size + length:
                message = pickle.loads(buf[FRAME.size : FRAME.size + length])
                del buf[: FRAME.size + length]
                return message
        return Stop() if self._closed else None

    def _receive(self, flags: int) -> None:
        try:
            data = self._stream.recv(1 << 16, flags)
        except BlockingIOError:
            return
        except ConnectionError:
            data = b""
        if not data:
            self._closed = True
        self._buf += data

    def reply(self) -> Any:
        """The worker's answer during start-up (before the core runs), waiting for it."""
        return self._wait()

    def _wait(self) -> Any:
        while (message := self._next()) is None:
            self._receive(0)
        return message


def _send_event(stream: socket.socket, message: tuple[Any, ...]) -> None:
    payload = _dumps(message)
    stream.sendall(FRAME.pack(len(payload)) + payload)


class _SocketEvents:
    """The core's events, sent to the worker. Measurements, and the garbage collector's pauses,
    ride with the next step's message (never sent from the collector's callback, which may run in
    the middle of a send)."""

    def __init__(self, stream: socket.socket, load: LoadState) -> None:
        self._stream = stream
        self._load = load
        self._queue_sent: tuple[list[list[Any]], list[list[int]]] | None = None
        self._gc_pauses: list[tuple[int, float]] = []

    def gc_paused(self, generation: int, seconds: float) -> None:
        """A ``yutu.gcpauses`` listener."""
        self._gc_pauses.append((generation, seconds))

    def _send(self, message: tuple[Any, ...]) -> None:
        _send_event(self._stream, message)

    def _changes(
        self,
    ) -> tuple[
        list[list[float]],
        list[list[float]],
        tuple[list[list[Any]], list[list[int]]] | None,
        list[tuple[int, float]],
    ]:
        load = self._load
        queue = (load.queued, load.decoding)
        fresh = None if self._queue_sent is not None and queue[0] is self._queue_sent[0] else queue
        self._queue_sent = queue
        pauses, self._gc_pauses = self._gc_pauses, []
        return LoadState.drain(load.steps), LoadState.drain(load.prefills), fresh, pauses

    def outputs(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._send(("out", outputs, stats, *self._changes()))

    def measured(self, load: LoadState, stats: EngineStats) -> None:
        if load.steps or load.prefills:
            return  # a step's measurement: sent with its outputs, next
        self._send(("load", stats, *self._changes()))

    def error(self, request_id: str, exc: BaseException) -> None:
        self._send(("error", request_id, *_error_parts(exc)))

    def loads(self, loads: list[KVLoad]) -> None:
        self._send(("loads", loads))

    def cache(self, events: list[CacheEvent], pinned: list[tuple[bytes, int]]) -> None:
        self._send(("cache", events, pinned))

    def check(self, token: int, result: dict[str, Any] | str) -> None:
        self._send(("check", token, result))

    def broken(self, reason: str, exc: BaseException) -> None:
        self._send(("broken", reason, *_error_parts(exc)))


# How long torch's OpenMP threads spin for more work after a parallel region (libgomp's default,
# 300,000, is ~10 ms here). A wide step's second thread spinning on after the step takes a core
# from whatever runs next -- the decode instance's first steps after a prefill instance's prompt.
# Measured on 2 cores, a 1,024-token prompt on two threads: 9 ms of CPU burnt in the 100 ms after
# the step by default, 0.1 ms at 10,000, the prompt as fast (69 ms against 72-74); OMP_WAIT_POLICY
# =PASSIVE (no spinning) made it 16% slower. Set only where the environment does not.
OMP_SPIN_COUNT = 10_000

_MAPPINGS: list[mmap.mmap] = []  # the child's view of the worker's KV region, kept for its lifetime


def _map_region(path: str, size: int, inode: int) -> memoryview:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_ino != inode:
            raise EngineProcessError(f"the KV region file {path} is not the one the worker registered")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    _MAPPINGS.append(mm)
    return memoryview(mm)


def child_main(args: ChildArgs) -> None:
    """The engine process: load the model into the worker's region, then serve the core."""
    from yutu.engine.cpus import name_this_process_an_engine
    from yutu.launcher import die_with
    from yutu.logs import setup_logging

    name_this_process_an_engine()  # before torch starts threads: the others are named alike

    # The worker decides when its engine stops (after draining): a terminal's Ctrl-C or a SIGTERM
    # sent to the whole group (systemd, a test harness) is the worker's to handle, not ours. The
    # child still never outlives the worker: SIGKILL when it dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with(args.parent_pid, signal.SIGKILL)()
    setup_logging(args.log_level, args.log_format)

    import torch
    from yutu.engine.engine import LLMEngine

    from services.worker.engine_core import EngineCore

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    events = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    events.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_BUFFER)
    events.connect(args.stream)
    commands = _StreamCommands(events)

    def factory(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        _send_event(events, ("region", list(shape), str(dtype).removeprefix("torch.")))
        tag, path, size, inode = commands.reply()
        assert tag == "region", f"expected the KV region, got {tag!r}"
        flat = torch.frombuffer(_map_region(path, size, inode), dtype=dtype)
        return flat.view(shape)

    try:
        engine = LLMEngine(dataclasses.replace(args.config, kv_cache_factory=factory))
    except BaseException as exc:  # noqa: BLE001 - the worker reports it as its start-up failure
        try:
            pickle.dumps(exc)
            failure: BaseException = exc
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text then
            failure = EngineProcessError(f"{type(exc).__name__}: {exc}")
        _send_event(events, ("failed", failure))
        events.close()
        return
    # Out of every later collection's walk (yutu.gcpauses): torch, the model and the engine's
    # start-up objects; a long pause left is logged as a warning in the worker's log.
    frozen = freeze_startup_heap()
    log.info("engine process: %d start-up objects frozen out of garbage collection", frozen)
    load = LoadState()
    sink = _SocketEvents(events, load)
    process_pauses().listeners.append(sink.gc_paused)
    _send_event(events, ("ready", EngineInfo.of(engine, torch.get_num_threads(), frozen), engine.stats()))
    core = EngineCore(
        engine, commands, sink, args.max_failed_steps,
        record_cache=args.record_cache, pin_stored=args.pin_stored, load=load,
    )  # fmt: skip
    core.serve()
    events.close()
