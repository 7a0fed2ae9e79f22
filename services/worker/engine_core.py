"""The engine core: the loop that applies commands to an :class:`LLMEngine` and steps it.

It is the same code whether it runs on a thread of the worker process
(:class:`~services.worker.engine_loop.EngineLoop`, the plain reference) or in a process of its
own (:class:`~services.worker.engine_process.EngineProcess`, the default): only where commands
come from (a :class:`Commands` source) and where events go (an :class:`Events` sink) differ::

    commands (the worker's event loop)         events (back to the event loop)
    Add / Abort / FinishLoad / Release /        outputs(tokens, stats)   one call per step
    Unpin / Check / Stop                        error(id, exc)           refused / failed requests
                                                loads(loads)             KVLoads admitted
                                                cache(events, pinned)    prefix-cache events
                                                check(token, result)     a Check's answer
                                                broken(reason, exc)      once, when broken

Failures, from the smallest to the largest:

- a request the engine refuses (a ValueError from ``add_request``, or an output ``refused`` later:
  its grammar did not compile): ``error(id, exc)``;
- a request the engine failed in a step (``RequestOutput.error``: the step raised, or its logits were
  not finite): ``error(id, RequestFailedError)``, kind INTERNAL; the engine goes on;
- the engine is *broken*: ``max_failed_steps`` steps failed in a row with no success, ``step()``
  raised (EngineBrokenError), or something failed outside a step. Then ``broken(reason, exc)`` is
  sent once, every request still in the engine is aborted, and the core stays up only to answer
  commands: each later ``Add`` fails at once with :class:`EngineUnavailableError` (kind
  UNAVAILABLE). Nothing is retried.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from yutu.engine.engine import EngineStats, KVLoad, LLMEngine, RequestOutput
from yutu.engine.errors import EngineBrokenError, InvalidRequestError, RequestFailedError
from yutu.engine.sampling import SamplingParams
from yutu.errors import ErrorKind, YutuError
from yutu.kv.block_manager import CacheEvent

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # consecutive failed steps (no success between) that make the engine broken
MEASUREMENTS_KEPT = 512  # measurements the loop has not collected yet are dropped past this
QUEUE_SNAPSHOT_S = 0.05  # the queue snapshot is refreshed at most this often


class EngineUnavailableError(YutuError):
    """The worker's engine is broken: the request was not run. Retry on another worker."""

    kind = ErrorKind.UNAVAILABLE


@dataclass(frozen=True)
class EngineInfo:
    """What the worker needs to know of its engine, fixed once the model is loaded."""

    vocab_size: int
    demo: bool  # the built-in demo model (random weights)
    max_model_len: int
    dtype: str  # "float32", "bfloat16", ...
    device: str  # where it computes: "cpu", "cuda", ...
    kv_salt: str  # what block keys are salted with (model and dtype)
    kernels: str  # what the engine computes with on CPU: "native" or "torch" (yutu.engine.native)
    root_key: bytes
    torch_threads: int  # the model step's threads
    prefill_threads: int  # the most threads of a wide step (a long prompt's chunk; yutu.engine.cpus)
    # Objects its process froze out of garbage collection once the model was loaded (yutu.gcpauses);
    # None for an engine on a thread of the worker, whose process freezes as every service does.
    gc_frozen_objects: int | None = None

    @classmethod
    def of(cls, engine: LLMEngine, torch_threads: int, gc_frozen_objects: int | None = None) -> EngineInfo:
        return cls(
            vocab_size=engine.model_config.vocab_size,
            demo=bool(engine.model_config.yutu_demo),
            max_model_len=engine.max_model_len,
            dtype=str(engine.dtype).removeprefix("torch."),
            device=engine.device.type,
            kv_salt=engine.kv_salt,
            kernels=engine.kernels,
            root_key=engine.root_key,
            torch_threads=torch_threads,
            prefill_threads=engine.config.prefill_threads or torch_threads,
            gc_frozen_objects=gc_frozen_objects,
        )


# -- commands ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generated: tuple[int, ...] = ()
    import_tokens: int = 0
    prefill_only: bool = False
    await_token: bool = False
    cache_salt: str | None = None
    priority: int = 0


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class FinishLoad:
    request_id: str
    num_tokens: int
    token: int | None = None  # the first token of a request admitted awaiting it


@dataclass(frozen=True)
class Release:
    request_id: str


@dataclass(frozen=True)
class Unpin:
    block_ids: list[int]


@dataclass(frozen=True)
class Check:
    """Check the block manager's invariants between steps; answered by ``Events.check``."""

    token: int


@dataclass(frozen=True)
class Stop:
    pass


Command = Add | Abort | FinishLoad | Release | Unpin | Check | Stop


class Commands(Protocol):
    def get(self) -> Command:
        """The next command, waiting for one."""
        ...

    def get_nowait(self) -> Command | None:
        """The next command if one is queued, else None."""
        ...


class Events(Protocol):
    def outputs(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """After every step: its outputs that carry tokens (maybe none) and the engine's stats."""
        ...

    def error(self, request_id: str, exc: BaseException) -> None: ...
    def loads(self, loads: list[KVLoad]) -> None:
        """The imports a step admitted, from inside the step, before its forward pass (``on_loads``)."""
        ...

    def cache(self, events: list[CacheEvent], pinned: list[tuple[bytes, int]]) -> None: ...
    def check(self, token: int, result: dict[str, Any] | str) -> None: ...
    def measured(self, load: LoadState, stats: EngineStats) -> None:
        """Called after the core changed ``load`` (measurements or the queue snapshot)."""
        ...

    def broken(self, reason: str, exc: BaseException) -> None: ...


@dataclass
class LoadState:
    """What the engine core measured and queued, for load reports.

    The core appends to the deques and replaces the lists (never mutates them in place), so a
    reader on another thread can read them without a lock.
    """

    prefills: deque[list[float]] = field(default_factory=lambda: deque(maxlen=MEASUREMENTS_KEPT))
    steps: deque[list[float]] = field(default_factory=lambda: deque(maxlen=MEASUREMENTS_KEPT))
    queued: list[list[Any]] = field(default_factory=list)  # [prompt_len, reused, computed, id] per prefill
    decoding: list[list[int]] = field(default_factory=list)  # [context_tokens, remaining] per decode

    @staticmethod
    def drain(measurements: deque[list[float]]) -> list[list[float]]:
        out = []
        while measurements:
            out.append(measurements.popleft())
        return out


class EngineCore:
    """Runs one engine: ``serve()`` returns on Stop; it never raises."""

    def __init__(
        self,
        engine: LLMEngine,
        commands: Commands,
        events: Events,
        max_failed_steps: int = MAX_FAILED_STEPS,
        *,
        record_cache: bool = False,
        pin_stored: bool = False,
        load: LoadState | None = None,
    ) -> None:
        """``record_cache``: prefix-cache events are recorded and sent (``pin_stored``: each stored
        block is pinned for the worker, who unpins it with ``Unpin``)."""
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {max_failed_steps}")
        self.engine = engine
        self._commands = commands
        self._events = events
        self._max_failed_steps = max_failed_steps
        self._record_cache = record_cache
        self._pin_stored = pin_stored
        if record_cache:
            engine.block_manager.record_events = True
        # A step's imports go to the worker before its forward pass: the KV copy overlaps the step.
        engine.on_loads = events.loads
        self.load = load if load is not None else LoadState()
        self._snapshot_at = 0.0
        self.failure: BaseException | None = None  # set if even the broken mode failed

    def serve(self) -> None:
        try:
            try:
                self._serve()
                return
            except Exception as exc:  # noqa: BLE001 - the engine is broken, the worker is not
                reason = f"{type(exc).__name__}: {exc}"
                log.exception("engine broken: %s", reason)
                self._events.broken(reason, exc)
            self._serve_broken()
        except BaseException as exc:  # noqa: BLE001 - even the broken mode failed: the core ends
            log.exception("engine core died")
            self.failure = exc
            self._events.broken(f"engine core died: {exc!r}", exc)

    def _serve(self) -> None:
        """Apply commands and step until Stop (returns) or a broken engine (raises)."""
        engine = self.engine
        while True:
            # Idle: sleep until a command comes. Busy: take what is queued, then step.
            command = (
                self._commands.get_nowait() if engine.has_unfinished_requests() else self._commands.get()
            )
            while command is not None:
                if isinstance(command, Stop):
                    return
                self._apply(command)
                command = self._commands.get_nowait()
            if engine.has_unfinished_requests():
                # The commands' cache events (a finished load's blocks) go out with the step's,
                # after it: not between a handoff's last message and the step that decodes it.
                outputs = engine.step()  # contains its own failures; raises only when broken
                stats = engine.stats()
                self._measure(outputs, stats)
                self._deliver(outputs, stats)
                self._publish_cache()
                failed = engine.consecutive_failed_steps
                if failed >= self._max_failed_steps:
                    raise EngineBrokenError(
                        f"{failed} engine steps failed in a row (last: {engine.last_failure})"
                    )
            else:
                self._publish_cache()
                self.load.queued, self.load.decoding = engine.queue_snapshot()
                self._events.measured(self.load, engine.stats())

    def _serve_broken(self) -> None:
        """Abort what the engine holds, then answer commands without running anything until Stop."""
        try:
            aborted = self.engine.abort_all()
            log.info("broken engine: aborted %d request(s)", len(aborted))
        except Exception:  # noqa: BLE001 - a broken engine may fail this too; nothing runs on it anyway
            log.exception("broken engine: could not abort its requests")
        while True:
            command = self._commands.get()
            if isinstance(command, Stop):
                return
            if isinstance(command, Add):  # queued before the worker learnt we were broken
                exc = EngineUnavailableError("this worker's engine is broken; retry on another worker")
                self._events.error(command.request_id, exc)
            elif isinstance(command, Check):
                self._events.check(command.token, "the engine is broken")

    def _deliver(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._events.outputs([out for out in outputs if not out.failed], stats)
        for out in outputs:  # after the tokens: a request may have got some before its step failed
            if out.refused:  # its grammar, found once compiled: as add_request's refusals are
                self._events.error(out.request_id, InvalidRequestError(out.error or "refused"))
            elif out.failed:
                self._events.error(
                    out.request_id, RequestFailedError(out.error or "the engine failed this request")
                )

    def _apply(self, command: Add | Abort | FinishLoad | Release | Unpin | Check) -> None:
        engine = self.engine
        if isinstance(command, Abort):
            engine.abort_request(command.request_id)
        elif isinstance(command, FinishLoad):
            try:
                engine.finish_load(command.request_id, command.num_tokens, command.token)
            except ValueError as exc:  # a load the engine cannot take: that request fails, not the engine
                engine.abort_request(command.request_id)
                engine.finish_load(command.request_id, 0)  # aborted while loading: frees its blocks
                self._events.error(command.request_id, exc)
        elif isinstance(command, Release):
            engine.release(command.request_id)
        elif isinstance(command, Unpin):
            engine.block_manager.unpin(command.block_ids)
        elif isinstance(command, Check):
            self._check(command.token)
        else:
            try:
                engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    generated=command.generated,
                    import_tokens=command.import_tokens,
                    prefill_only=command.prefill_only,
                    await_token=command.await_token,
                    cache_salt=command.cache_salt,
                    priority=command.priority,
                )
            except ValueError as exc:  # the engine's typed input errors are ValueErrors
                self._events.error(command.request_id, exc)

    def _check(self, token: int) -> None:
        bm = self.engine.block_manager
        try:
            bm.check_integrity()
        except AssertionError as exc:
            self._events.check(token, f"block manager invariant broken: {exc}")
            return
        self._events.check(
            token, {"ok": True, "used_blocks": bm.num_used_blocks, "held": self.engine.num_held}
        )

    def _publish_cache(self) -> None:
        """Send the prefix-cache events, pinning stored blocks for write-behind first."""
        if not self._record_cache:
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
        self._events.cache(events, pinned)

    def _measure(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """Keep the step's measurements and (at most every QUEUE_SNAPSHOT_S) the queue's state."""
        step = self.engine.last_step
        changed = False
        if step is not None and step.num_decodes and not step.num_prefill_tokens:
            self.load.steps.append([step.num_decodes, step.decode_kv_tokens, step.seconds])
            changed = True
        for out in outputs:
            if out.prefill_s is not None and out.prefill_s > 0:
                self.load.prefills.append([out.num_prompt_tokens, out.num_cached_tokens, out.prefill_s])
                changed = True
        now = time.monotonic()
        if now - self._snapshot_at >= QUEUE_SNAPSHOT_S:
            self._snapshot_at = now
            self.load.queued, self.load.decoding = self.engine.queue_snapshot()
            changed = True
        if changed:
            self._events.measured(self.load, stats)
