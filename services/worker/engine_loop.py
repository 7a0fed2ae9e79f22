"""The engine on a thread of the worker process: the plain reference front of the engine core.

:class:`EngineLoop` runs :class:`~services.worker.engine_core.EngineCore` on a dedicated thread;
all its methods are called from the event loop. Commands go in through a thread-safe queue;
events come back to the loop with ``call_soon_threadsafe``. When there is nothing to run, the
thread sleeps on the queue instead of spinning::

    event loop                     engine thread
    add()/abort()  -- commands --> apply, then step() while work is left
    finish_load() / release() / unpin() / check()  (the disaggregation commands, see LLMEngine)
    on_outputs()  <-- outputs ---  list[RequestOutput] per step (tokens; never a failed output)
    on_error()    <-- failures --  (request_id, exception) for requests refused or failed
    on_error()    <-- broken ----  ("", exception) once, when the engine is declared broken
    on_loads()    <-- imports ---  KVLoads admitted (copy their KV in, then finish_load)
    on_cache()    <-- cache -----  prefix-cache events, and the stored blocks pinned for write-behind

The engine thread and the event loop share the process's GIL, so the loop's Python per token
lands on the engine's critical path; :class:`~services.worker.engine_process.EngineProcess` (the
default, same interface) runs the same core in a process of its own. Failures: see
:mod:`services.worker.engine_core`; once broken, ``broken`` says why (set on the event loop,
before ``on_error("", exc)``) and each later ``add`` fails with :class:`EngineUnavailableError`.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

from yutu.engine.engine import EngineStats, KVLoad, LLMEngine, RequestOutput
from yutu.engine.sampling import SamplingParams
from yutu.kv.block_manager import CacheEvent

from services.worker.engine_core import (
    MAX_FAILED_STEPS,
    Abort,
    Add,
    Check,
    Command,
    EngineCore,
    EngineUnavailableError,
    FinishLoad,
    LoadState,
    Release,
    Stop,
    Unpin,
)

__all__ = ["EngineLoop", "EngineUnavailableError", "LoadState", "MAX_FAILED_STEPS", "OnCache", "OnLoads"]

OnLoads = Callable[[list[KVLoad]], None]
OnCache = Callable[[list[CacheEvent], list[tuple[bytes, int]]], None]  # events, pinned (key, block)
OnOutputs = Callable[[list[RequestOutput]], None]
OnError = Callable[[str, BaseException], None]


class _Queue:
    """The core's command source: a thread-safe queue."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Command] = queue.SimpleQueue()

    def get(self) -> Command:
        return self.queue.get()

    def get_nowait(self) -> Command | None:
        try:
            return self.queue.get_nowait()
        except queue.Empty:
            return None


class EngineFront:
    """What the worker's event loop sees of its engine core, wherever the core runs.

    Subclasses send commands (``_send``) and call ``_event_*`` on the event loop as events arrive.
    """

    stats: EngineStats  # the engine's latest; replaced (never mutated) after every step

    def __init__(
        self,
        on_outputs: OnOutputs,
        on_error: OnError,
        *,
        on_loads: OnLoads | None = None,
        on_cache: OnCache | None = None,
    ) -> None:
        self._on_outputs = on_outputs
        self._on_error = on_error
        self._on_loads = on_loads
        self._on_cache = on_cache
        self.load = LoadState()
        self.broken: str | None = None  # why the engine cannot serve; set on the event loop, never reset
        self.failure: BaseException | None = None  # set if the engine core itself died
        self._checks: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._check_ids = itertools.count(1)

    def _send(self, command: Command) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        """Stop the core after the step it is in; wait until it has stopped."""
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        """The engine process, if the core runs in one."""
        return None

    def _fail_soon(self, request_id: str, exc: BaseException) -> None:
        raise NotImplementedError

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        generated: tuple[int, ...] = (),
        import_tokens: int = 0,
        prefill_only: bool = False,
        await_token: bool = False,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request (the keywords: see ``LLMEngine.add_request``); once the engine is broken,
        fail it (soon, via ``on_error``) instead."""
        if self.broken is not None:
            exc = EngineUnavailableError(
                f"this worker's engine is broken ({self.broken}); retry on another worker"
            )
            self._fail_soon(request_id, exc)
            return
        self._send(
            Add(
                request_id,
                prompt_token_ids,
                params,
                generated,
                import_tokens,
                prefill_only,
                await_token,
                cache_salt,
                priority,
            )  # fmt: skip
        )

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def finish_load(self, request_id: str, num_tokens: int, token: int | None = None) -> None:
        self._send(FinishLoad(request_id, num_tokens, token))

    def release(self, request_id: str) -> None:
        self._send(Release(request_id))

    def unpin(self, block_ids: list[int]) -> None:
        """Write-behind calls it from the event loop when it is done with blocks."""
        if block_ids:
            self._send(Unpin(list(block_ids)))

    async def check(self) -> dict[str, Any]:
        """The block manager's invariants, checked by the core between two steps. Raises
        AssertionError naming the broken invariant, RuntimeError when the engine is broken."""
        if not self.alive:
            raise RuntimeError(f"the engine is not running ({self.broken or 'stopped'})")
        token = next(self._check_ids)
        future = self._checks[token] = asyncio.get_running_loop().create_future()
        self._send(Check(token))
        try:
            return await future
        finally:
            self._checks.pop(token, None)

    # -- events, on the event loop ---------------------------------------------------------------

    def _event_outputs(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self.stats = stats
        if outputs:
            self._on_outputs(outputs)

    def _event_check(self, token: int, result: dict[str, Any] | str) -> None:
        future = self._checks.get(token)
        if future is None or future.done():
            return
        if isinstance(result, str):
            error: Exception = RuntimeError(result) if "broken" in result else AssertionError(result)
            future.set_exception(error)
        else:
            future.set_result(result)

    def _event_broken(self, reason: str, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = reason
            self._on_error("", exc)


class EngineLoop(EngineFront):
    """Owns an :class:`LLMEngine` on a dedicated thread; all methods are called from the event loop."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: OnOutputs,
        on_error: OnError,
        max_failed_steps: int = MAX_FAILED_STEPS,
        *,
        on_loads: OnLoads | None = None,
        on_cache: OnCache | None = None,
        pin_stored: bool = False,
    ) -> None:
        """``on_loads``: needed when requests import KV. ``on_cache``: prefix-cache events are
        recorded and delivered (``pin_stored``: each stored block is pinned for the caller, who
        unpins it with ``unpin``)."""
        super().__init__(on_outputs, on_error, on_loads=on_loads, on_cache=on_cache)
        self.engine = engine
        self._loop = loop
        self._commands = _Queue()
        self._core = EngineCore(
            engine, self._commands, _LoopEvents(self, loop), max_failed_steps,
            record_cache=on_cache is not None, pin_stored=pin_stored, load=self.load,
        )  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.stats = engine.stats()

    def start(self) -> None:
        self._thread.start()

    def _send(self, command: Command) -> None:
        self._commands.queue.put(command)

    def _fail_soon(self, request_id: str, exc: BaseException) -> None:
        self._loop.call_soon(self._on_error, request_id, exc)

    async def stop(self) -> None:
        self._send(Stop())
        await asyncio.to_thread(self._thread.join)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        self._core.serve()
        self.failure = self._core.failure


class _LoopEvents:
    """The core's events, handed to the event loop (called on the engine thread)."""

    def __init__(self, front: EngineLoop, loop: asyncio.AbstractEventLoop) -> None:
        self._front = front
        self._loop = loop

    def outputs(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        # Stats are replaced here, not on the loop: a later idle snapshot must never be overwritten
        # by a step's stats delivered after it. A plain attribute replacement is safe from this thread.
        self._front.stats = stats
        if outputs:
            self._loop.call_soon_threadsafe(self._front._on_outputs, outputs)

    def error(self, request_id: str, exc: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._front._on_error, request_id, exc)

    def loads(self, loads: list[KVLoad]) -> None:
        assert self._front._on_loads is not None, "a request imports KV but nobody copies it"
        self._loop.call_soon_threadsafe(self._front._on_loads, loads)

    def cache(self, events: list[CacheEvent], pinned: list[tuple[bytes, int]]) -> None:
        assert self._front._on_cache is not None
        self._loop.call_soon_threadsafe(self._front._on_cache, events, pinned)

    def check(self, token: int, result: dict[str, Any] | str) -> None:
        self._loop.call_soon_threadsafe(self._front._event_check, token, result)

    def measured(self, load: LoadState, stats: EngineStats) -> None:
        self._front.stats = stats  # ``load`` is the front's own LoadState: nothing to copy

    def broken(self, reason: str, exc: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._front._event_broken, reason, exc)
