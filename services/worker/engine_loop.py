"""The engine thread: the one place where the model runs.

The event loop never touches :class:`~yutu.engine.engine.LLMEngine` (it is not thread-safe and its
steps take milliseconds to seconds). Commands go in through a thread-safe queue; outputs come back
to the loop with ``call_soon_threadsafe``. When there is nothing to run, the thread sleeps on the
queue instead of spinning::

    event loop                     engine thread
    add()/abort()  -- commands --> apply, then step() while work is left
    on_outputs()  <-- outputs ---  list[RequestOutput] per step
    on_error()    <-- failures --  (request_id, exception) for requests the engine refused
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from yutu.engine.engine import EngineStats, LLMEngine, RequestOutput
from yutu.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


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
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_error = on_error
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.stats: EngineStats = engine.stats()  # replaced (never mutated) after every step
        self.failure: BaseException | None = None  # set if the engine thread died

    def start(self) -> None:
        self._thread.start()

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._commands.put(_Add(request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def stop(self) -> None:
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - reported to the service, which stops the worker
            log.exception("engine thread died")
            self.failure = exc
            self._loop.call_soon_threadsafe(self._on_error, "", exc)

    def _serve(self) -> None:
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
                outputs = self.engine.step()
                self.stats = self.engine.stats()
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs)
            else:
                self.stats = self.engine.stats()

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except ValueError as exc:  # the engine's typed input errors are ValueErrors
            self._loop.call_soon_threadsafe(self._on_error, command.request_id, exc)
