"""The engine thread: the one place where the model runs.

The event loop never touches :class:`~yutu.engine.engine.LLMEngine` (it is not thread-safe and its
steps take milliseconds to seconds). Commands go in through a thread-safe queue; outputs come back
to the loop with ``call_soon_threadsafe``. When there is nothing to run, the thread sleeps on the
queue instead of spinning::

    event loop                     engine thread
    add()/abort()  -- commands --> apply, then step() while work is left
    finish_load() / release() / unpin()  (the disaggregation commands, see LLMEngine)
    on_outputs()  <-- outputs ---  list[RequestOutput] per step (tokens; never a failed output)
    on_error()    <-- failures --  (request_id, exception) for requests refused or failed
    on_error()    <-- broken ----  ("", exception) once, when the engine is declared broken
    on_loads()    <-- imports ---  KVLoads admitted (copy their KV in, then finish_load)
    on_cache()    <-- cache -----  prefix-cache events, and the stored blocks pinned for write-behind

Measurements for the conductor's cost models (decode-only steps, prompt compute times) and a
snapshot of the queue are kept by the engine thread in :class:`LoadState` and read by the loop.

Failures, from the smallest to the largest:

- a request the engine refuses (a ValueError from ``add_request``): ``on_error(id, exc)``;
- a request the engine failed in a step (``RequestOutput.error``: the step raised, or its logits were
  not finite): ``on_error(id, RequestFailedError)``, kind INTERNAL; the engine goes on;
- the engine is *broken*: ``max_failed_steps`` steps failed in a row with no success, ``step()``
  raised (EngineBrokenError), or something failed outside a step. Then ``broken`` says why (set on
  the event loop, before ``on_error("", exc)`` is called), every request still in the engine is
  aborted, and the thread stays up only to answer commands: each later ``add`` fails at once with
  :class:`EngineUnavailableError` (kind UNAVAILABLE). Nothing is retried; the worker stays up to
  report the reason (``/ready``, registry meta) and a supervisor or operator replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from yutu.engine.engine import EngineStats, KVLoad, LLMEngine, RequestOutput
from yutu.engine.errors import EngineBrokenError, RequestFailedError
from yutu.engine.sampling import SamplingParams
from yutu.errors import ErrorKind, YutuError
from yutu.kv.block_manager import CacheEvent

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # consecutive failed steps (no success between) that make the engine broken


class EngineUnavailableError(YutuError):
    """The worker's engine is broken: the request was not run. Retry on another worker."""

    kind = ErrorKind.UNAVAILABLE


MEASUREMENTS_KEPT = 512  # measurements the loop has not collected yet are dropped past this
QUEUE_SNAPSHOT_S = 0.05  # the queue snapshot is refreshed at most this often


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generated: tuple[int, ...] = ()
    import_tokens: int = 0
    prefill_only: bool = False


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _FinishLoad:
    request_id: str
    num_tokens: int


@dataclass(frozen=True)
class _Release:
    request_id: str


@dataclass(frozen=True)
class _Unpin:
    block_ids: list[int]


class _Stop:
    pass


_Command = _Add | _Abort | _FinishLoad | _Release | _Unpin | _Stop

OnLoads = Callable[[list[KVLoad]], None]
OnCache = Callable[[list[CacheEvent], list[tuple[bytes, int]]], None]  # events, pinned (key, block)


@dataclass
class LoadState:
    """What the engine thread measured and queued, for load reports (read on the event loop).

    The engine thread appends to the deques and replaces the lists (never mutates them in place),
    so the loop can read them without a lock.
    """

    prefills: deque[list[float]] = field(default_factory=lambda: deque(maxlen=MEASUREMENTS_KEPT))
    steps: deque[list[float]] = field(default_factory=lambda: deque(maxlen=MEASUREMENTS_KEPT))
    queued: list[list[int]] = field(default_factory=list)  # [prompt_len, reused, computed] per prefill
    decoding: list[list[int]] = field(default_factory=list)  # [context_tokens, remaining] per decode

    @staticmethod
    def drain(measurements: deque[list[float]]) -> list[list[float]]:
        out = []
        while measurements:
            out.append(measurements.popleft())
        return out


class EngineLoop:
    """Owns an :class:`LLMEngine` on a dedicated thread; all methods are called from the event loop."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_error: Callable[[str, BaseException], None],
        max_failed_steps: int = MAX_FAILED_STEPS,
        *,
        on_loads: OnLoads | None = None,
        on_cache: OnCache | None = None,
        pin_stored: bool = False,
    ) -> None:
        """``on_loads``: needed when requests import KV. ``on_cache``: prefix-cache events are
        recorded and delivered (``pin_stored``: each stored block is pinned for the caller, who
        unpins it with ``unpin``)."""
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {max_failed_steps}")
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_error = on_error
        self._max_failed_steps = max_failed_steps
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._on_loads = on_loads
        self._on_cache = on_cache
        self._pin_stored = pin_stored
        if on_cache is not None:
            engine.block_manager.record_events = True
        self.load = LoadState()
        self._snapshot_at = 0.0
        self.stats: EngineStats = engine.stats()  # replaced (never mutated) after every step
        self.broken: str | None = None  # why the engine cannot serve; set on the event loop, never reset
        self.failure: BaseException | None = None  # set if the engine thread itself died

    def start(self) -> None:
        self._thread.start()

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        generated: tuple[int, ...] = (),
        import_tokens: int = 0,
        prefill_only: bool = False,
    ) -> None:
        """Queue a request (the keywords: see ``LLMEngine.add_request``); once the engine is broken,
        fail it (soon, via ``on_error``) instead."""
        if self.broken is not None:
            exc = EngineUnavailableError(
                f"this worker's engine is broken ({self.broken}); retry on another worker"
            )
            self._loop.call_soon(self._on_error, request_id, exc)
            return
        self._commands.put(_Add(request_id, prompt_token_ids, params, generated, import_tokens, prefill_only))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def finish_load(self, request_id: str, num_tokens: int) -> None:
        self._commands.put(_FinishLoad(request_id, num_tokens))

    def release(self, request_id: str) -> None:
        self._commands.put(_Release(request_id))

    def unpin(self, block_ids: list[int]) -> None:
        """Thread-safe: write-behind calls it from the event loop when it is done with blocks."""
        if block_ids:
            self._commands.put(_Unpin(list(block_ids)))

    async def stop(self) -> None:
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            try:
                self._serve()
                return
            except Exception as exc:  # noqa: BLE001 - the engine is broken, the worker is not
                reason = f"{type(exc).__name__}: {exc}"
                log.exception("engine broken: %s", reason)
                self._loop.call_soon_threadsafe(self._declare_broken, reason, exc)
            self._serve_broken()
        except BaseException as exc:  # noqa: BLE001 - even the broken mode failed: the thread dies
            log.exception("engine thread died")
            self.failure = exc
            self._loop.call_soon_threadsafe(self._declare_broken, f"engine thread died: {exc!r}", exc)

    def _serve(self) -> None:
        """Apply commands and step until a stop command (returns) or a broken engine (raises)."""
        while True:
            # Idle: sleep until a command comes. Busy: take what is queued, then step.
            command: _Command | None
            if self.engine.has_unfinished_requests():
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            else:
                command = self._commands.get()
            while command is not None:
                if isinstance(command, _Stop):
                    return
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            self._publish_cache()
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()  # contains its own failures; raises only when broken
                self.stats = self.engine.stats()
                self._measure(outputs)
                self._deliver(outputs)
                self._publish_cache()
                loads = self.engine.take_loads()
                if loads:
                    assert self._on_loads is not None, "a request imports KV but nobody copies it"
                    self._loop.call_soon_threadsafe(self._on_loads, loads)
                failed = self.engine.consecutive_failed_steps
                if failed >= self._max_failed_steps:
                    raise EngineBrokenError(
                        f"{failed} engine steps failed in a row (last: {self.engine.last_failure})"
                    )
            else:
                self.stats = self.engine.stats()
                self.load.queued, self.load.decoding = self.engine.queue_snapshot()

    def _serve_broken(self) -> None:
        """Abort what the engine holds, then answer commands without running anything until stopped."""
        try:
            aborted = self.engine.abort_all()
            self.stats = self.engine.stats()
            log.info("broken engine: aborted %d request(s)", len(aborted))
        except Exception:  # noqa: BLE001 - a broken engine may fail this too; nothing runs on it anyway
            log.exception("broken engine: could not abort its requests")
        while True:
            command = self._commands.get()
            if isinstance(command, _Stop):
                return
            if isinstance(command, _Add):  # queued before the event loop learnt we were broken
                exc = EngineUnavailableError("this worker's engine is broken; retry on another worker")
                self._loop.call_soon_threadsafe(self._on_error, command.request_id, exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        tokens = [out for out in outputs if not out.failed]
        failed = [out for out in outputs if out.failed]
        if tokens:
            self._loop.call_soon_threadsafe(self._on_outputs, tokens)
        for out in failed:  # after the tokens: a request may have got some before its step failed
            exc = RequestFailedError(out.error or "the engine failed this request")
            self._loop.call_soon_threadsafe(self._on_error, out.request_id, exc)

    def _apply(self, command: _Add | _Abort | _FinishLoad | _Release | _Unpin) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
        elif isinstance(command, _FinishLoad):
            self.engine.finish_load(command.request_id, command.num_tokens)
        elif isinstance(command, _Release):
            self.engine.release(command.request_id)
        elif isinstance(command, _Unpin):
            self.engine.block_manager.unpin(command.block_ids)
        else:
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    generated=command.generated,
                    import_tokens=command.import_tokens,
                    prefill_only=command.prefill_only,
                )
            except ValueError as exc:  # the engine's typed input errors are ValueErrors
                self._loop.call_soon_threadsafe(self._on_error, command.request_id, exc)

    def _publish_cache(self) -> None:
        """Hand the prefix-cache events to the loop, pinning stored blocks for write-behind first."""
        if self._on_cache is None:
            return
        events = self.engine.take_cache_events()
        if not events:
            return
        pinned: list[tuple[bytes, int]] = []
        if self._pin_stored:
            bm = self.engine.block_manager
            stored = [e for e in events if e.stored and bm.block_key(e.block_id) == e.key]
            bm.pin([e.block_id for e in stored])
            pinned = [(e.key, e.block_id) for e in stored]
        self._loop.call_soon_threadsafe(self._on_cache, events, pinned)

    def _measure(self, outputs: list[RequestOutput]) -> None:
        """Keep the step's measurements and (at most every QUEUE_SNAPSHOT_S) the queue's state."""
        step = self.engine.last_step
        if step is not None and step.num_decodes and not step.num_prefill_tokens:
            self.load.steps.append([step.num_decodes, step.decode_kv_tokens, step.seconds])
        for out in outputs:
            if out.prefill_s is not None and out.prefill_s > 0:
                self.load.prefills.append([out.num_prompt_tokens, out.num_cached_tokens, out.prefill_s])
        now = time.monotonic()
        if now - self._snapshot_at >= QUEUE_SNAPSHOT_S:
            self._snapshot_at = now
            self.load.queued, self.load.decoding = self.engine.queue_snapshot()

    # -- the event loop --------------------------------------------------------------------------

    def _declare_broken(self, reason: str, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = reason
            self._on_error("", exc)
