"""The engine thread: the one place where the model runs.

The event loop never touches :class:`~yutu.engine.engine.LLMEngine` (it is not thread-safe and its
steps take milliseconds to seconds). Commands go in through a thread-safe queue; outputs come back
to the loop with ``call_soon_threadsafe``. When there is nothing to run, the thread sleeps on the
queue instead of spinning::

    event loop                     engine thread
    add()/abort()  -- commands --> apply, then step() while work is left
    on_outputs()  <-- outputs ---  list[RequestOutput] per step (tokens; never a failed output)
    on_error()    <-- failures --  (request_id, exception) for requests refused or failed
    on_error()    <-- broken ----  ("", exception) once, when the engine is declared broken

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
from collections.abc import Callable
from dataclasses import dataclass

from yutu.engine.engine import EngineStats, LLMEngine, RequestOutput
from yutu.engine.errors import EngineBrokenError, RequestFailedError
from yutu.engine.sampling import SamplingParams
from yutu.errors import ErrorKind, YutuError

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # consecutive failed steps (no success between) that make the engine broken


class EngineUnavailableError(YutuError):
    """The worker's engine is broken: the request was not run. Retry on another worker."""

    kind = ErrorKind.UNAVAILABLE


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class EngineLoop:
    """Owns an :class:`LLMEngine` on a dedicated thread; all methods are called from the event loop."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_error: Callable[[str, BaseException], None],
        max_failed_steps: int = MAX_FAILED_STEPS,
    ) -> None:
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {max_failed_steps}")
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_error = on_error
        self._max_failed_steps = max_failed_steps
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.stats: EngineStats = engine.stats()  # replaced (never mutated) after every step
        self.broken: str | None = None  # why the engine cannot serve; set on the event loop, never reset
        self.failure: BaseException | None = None  # set if the engine thread itself died

    def start(self) -> None:
        self._thread.start()

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; once the engine is broken, fail it (soon, via ``on_error``) instead."""
        if self.broken is not None:
            exc = EngineUnavailableError(
                f"this worker's engine is broken ({self.broken}); retry on another worker"
            )
            self._loop.call_soon(self._on_error, request_id, exc)
            return
        self._commands.put(_Add(request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

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
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()  # contains its own failures; raises only when broken
                self.stats = self.engine.stats()
                self._deliver(outputs)
                failed = self.engine.consecutive_failed_steps
                if failed >= self._max_failed_steps:
                    raise EngineBrokenError(
                        f"{failed} engine steps failed in a row (last: {self.engine.last_failure})"
                    )
            else:
                self.stats = self.engine.stats()

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

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except ValueError as exc:  # the engine's typed input errors are ValueErrors
            self._loop.call_soon_threadsafe(self._on_error, command.request_id, exc)

    # -- the event loop --------------------------------------------------------------------------

    def _declare_broken(self, reason: str, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = reason
            self._on_error("", exc)
