"""Running the worker requests of one API request and turning their tokens into text.

A :class:`Generation` submits one worker request per :class:`ChoiceSpec`, at most
``max_in_flight`` at a time (the next as each one ends, in index order), so one request's many
choices never take every running slot of the workers while other users wait. For each choice it
detokenizes incrementally, applies the stop strings (truncating the text before the match and
aborting the worker request), and yields :class:`ChoiceUpdate`\\ s in arrival order, all choices
interleaved. Use it as an async context manager: leaving the block (normally, on an error, or
cancelled because the client went away) aborts every worker request still running, synchronously,
so the workers free their KV blocks even when the leaving task is being cancelled.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

from yutu.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from yutu.errors import ErrorKind, YutuError
from yutu.protocol.generate import GenerateRequest, TokenDelta

from services.gateway.metrics import GatewayMetrics
from services.gateway.prompts import ChoiceSpec
from services.gateway.routing import Handle, Route, Router
from services.gateway.stop import StopMatcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenInfo:
    """A generated token as the API shows it."""

    token_id: int
    text_offset: int  # where this token's text starts in the choice's text (chars, before truncation)
    logprob: float | None  # None when logprobs were not asked for
    top: list[tuple[int, float]]  # top alternatives (token id, logprob), best first


@dataclass
class ChoiceUpdate:
    """New output of one choice: text to append, the tokens it came from, and the end if reached."""

    index: int
    text: str
    tokens: list[TokenInfo]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class ChoiceState:
    """Everything one choice produced so far (for usage and non-streamed responses)."""

    spec: ChoiceSpec
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[Any] | None = None  # when asked: one entry per prompt token (TokenDelta's form)


@dataclass(frozen=True)
class UsageCount:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


_ids = itertools.count()


class Generation:
    """The choices of one API request, placed and run by ``router``."""

    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer,
        specs: list[ChoiceSpec],
        request_id: str,
        metrics: GatewayMetrics,
        max_in_flight: int,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.router = router
        self.max_in_flight = max_in_flight
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.metrics = metrics
        self.arrival = time.time()
        self.arrival_mono = time.monotonic()
        self.choices = {spec.index: ChoiceState(spec) for spec in specs}
        self._waiting = deque(self.choices[i] for i in sorted(self.choices))  # not submitted yet
        self._running = 0  # choices submitted and not ended
        self._handles: dict[int, Handle] = {}
        self.routes: dict[int, Route] = {}  # where each started choice runs (the x-yutu-* headers)
        self._tasks: list[asyncio.Task[None]] = []
        self._events: asyncio.Queue[ChoiceUpdate | YutuError | None] = asyncio.Queue()
        self._started = False
        self._placed: list[tuple[ChoiceState, GenerateRequest, Route]] = []  # placed, not yet run

    async def __aenter__(self) -> Generation:
        if not self._started:  # (a streaming route starts it before its response does)
            if not self._placed:
                await self.place()
            self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def place(self) -> None:
        """Place the first choices (nothing runs yet); raises YutuError (429, 503) so that a route
        can still answer with that status, and name the instances in its headers, before a
        response starts. ``start`` (or ``async with``) then runs them."""
        assert not self._placed and not self._started
        log.info("request %s: %d choice(s) of %d prompt token(s)", self.request_id, len(self.choices),
                 len(next(iter(self.choices.values())).spec.prompt_ids))  # fmt: skip
        self._placed = await self._place_waiting()

    def start(self) -> None:
        """Run the placed choices (``place`` first); later ones are placed as earlier ones end."""
        assert not self._started
        self._started = True
        self.metrics.in_flight.labels(self.metrics.model).inc()
        placed, self._placed = self._placed, []
        try:
            self._run_placed(placed)
        except BaseException:
            self.close()
            raise

    @property
    def first_routes(self) -> list[Route]:
        """Where the first choices run (after ``place``), in index order."""
        if self._placed:
            return [route for _, _, route in self._placed]
        return [self.routes[i] for i in sorted(self.routes)]

    def current_routes(self) -> list[Route]:
        """Where the choices ran in the end (a request placed again after a lost prefill instance
        reports the one that served it), in index order."""
        out = []
        for index in sorted(self.routes):
            handle = self._handles.get(index)
            route = getattr(handle, "route", None)
            out.append(route if isinstance(route, Route) else self.routes[index])
        return out

    async def _place_waiting(self) -> list[tuple[ChoiceState, GenerateRequest, Route]]:
        """Take waiting choices, lowest index first, while fewer than max_in_flight run, and place them."""
        batch: list[tuple[ChoiceState, GenerateRequest]] = []
        while self._waiting and self._running + len(batch) < self.max_in_flight:
            state = self._waiting.popleft()
            spec = state.spec
            request = GenerateRequest(
                request_id=f"{self.request_id}-{spec.index}-{next(_ids)}",
                prompt_token_ids=spec.prompt_ids,
                sampling=_sampling_dict(spec),
                arrival_time=self.arrival,
                cache_salt=spec.cache_salt,
                priority=spec.priority,
            )
            batch.append((state, request))
        routes = await asyncio.gather(*(self.router.place(request) for _, request in batch))
        return [(state, request, route) for (state, request), route in zip(batch, routes, strict=True)]

    def _run_placed(self, placed: list[tuple[ChoiceState, GenerateRequest, Route]]) -> None:
        for state, request, route in placed:
            handle = self.router.start(request, route)
            self._running += 1
            self._handles[state.spec.index] = handle
            self.routes[state.spec.index] = route
            self._tasks.append(asyncio.create_task(self._run(state, handle)))

    def close(self) -> None:
        """Abort what still runs; synchronous so it also works inside a cancelled task."""
        self._waiting.clear()  # first: a choice ending now must not submit another
        for task in self._tasks:
            task.cancel()
        for handle in self._handles.values():
            handle.close()
        if self._started:
            self._started = False
            self.metrics.in_flight.labels(self.metrics.model).dec()

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Updates of all choices as they come; raises YutuError if any choice fails."""
        remaining = len(self.choices)  # each choice ends with None (after its error, if any)
        while remaining:
            event = await self._events.get()
            if event is None:
                remaining -= 1
            elif isinstance(event, YutuError):
                raise event
            else:
                yield event

    async def run_to_end(self) -> dict[int, ChoiceState]:
        """Wait for every choice to finish (for non-streamed responses)."""
        async for _ in self.updates():
            pass
        return self.choices

    def usage(self) -> UsageCount:
        """Prompt tokens counted once per prompt (its first choice), completion tokens of all choices."""
        prompt = cached = completion = 0
        seen: set[int] = set()
        for state in sorted(self.choices.values(), key=lambda s: s.spec.index):
            completion += len(state.tokens)
            if state.spec.prompt_index not in seen:
                seen.add(state.spec.prompt_index)
                prompt += state.num_prompt_tokens or len(state.spec.prompt_ids)
                cached += state.num_cached_tokens
        return UsageCount(prompt, completion, cached)

    async def _run(self, state: ChoiceState, handle: Handle) -> None:
        failed = False
        try:
            await self._consume(state, handle)
        except YutuError as exc:
            failed = True
            self.metrics.finished.labels(self.metrics.model, "error").inc()
            self._events.put_nowait(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the client as a 500, not a hang
            failed = True
            self._events.put_nowait(_internal(exc))
        finally:
            handle.close()
            self._running -= 1
            if failed:
                self._waiting.clear()  # the response fails: run no more of its choices
            self._events.put_nowait(None)
        if self._waiting and self._started:
            await self._submit_next()

    async def _submit_next(self) -> None:
        """A choice ended: place and run the next waiting ones; a failure to do so fails the response."""
        try:
            placed = await self._place_waiting()
            if self._started:  # not closed meanwhile (the client went away)
                self._run_placed(placed)
        except YutuError as exc:
            self._waiting.clear()
            self._events.put_nowait(exc)
        except Exception as exc:  # noqa: BLE001 - surfaced to the client as a 500, not a hang
            self._waiting.clear()
            self._events.put_nowait(_internal(exc))

    async def _consume(self, state: ChoiceState, handle: Handle) -> None:
        spec = state.spec
        detok = IncrementalDetokenizer(self.tokenizer, spec.prompt_ids, spec.skip_special_tokens)
        matcher = StopMatcher(spec.stops, spec.include_stop)
        offset = 0  # chars of detokenized text so far
        last_token_at: float | None = None
        stop_ids = set(spec.sampling.stop_token_ids)
        # Kept special tokens are text, but not the one that ends the output (an eos, a stop token
        # id): the text is the same as with them skipped, up to where the model stopped.
        enders = (
            set()
            if spec.skip_special_tokens
            else self.tokenizer.special_token_ids & (stop_ids | set(self.tokenizer.eos_token_ids))
        )
        while True:
            delta: TokenDelta = await handle.next()
            if spec.score_only:  # max_tokens 0 (echo): the one token the worker computed is not shown
                delta = replace(
                    delta, token_ids=[], logprobs=None, finish_reason=delta.finish_reason and "length"
                )
            now = time.monotonic()
            self.metrics.observe_tokens(self.arrival_mono, last_token_at, now, len(delta.token_ids))
            if delta.token_ids:
                last_token_at = now
            state.num_prompt_tokens = delta.num_prompt_tokens or state.num_prompt_tokens
            state.num_cached_tokens = delta.num_cached_tokens or state.num_cached_tokens
            update = ChoiceUpdate(spec.index, "", [])
            if delta.prompt_logprobs is not None:
                state.prompt_logprobs = delta.prompt_logprobs
            lps = delta.logprobs or []
            for i, token_id in enumerate(delta.token_ids):
                lp = lps[i] if i < len(lps) else None
                update.tokens.append(
                    TokenInfo(
                        token_id=token_id,
                        text_offset=offset,
                        logprob=None if lp is None else float(lp[1]),
                        top=[] if lp is None else [(int(a), float(b)) for a, b in lp[2]],
                    )
                )
                ends = delta.finish_reason == "stop" and i == len(delta.token_ids) - 1 and token_id in enders
                piece = "" if ends else detok.push([token_id])
                offset += len(piece)
                shown, matched = matcher.feed(piece)
                update.text += shown
                if matched is not None:
                    update.finish_reason, update.stop_reason = "stop", matched
                    break
            if update.finish_reason is None and delta.finish_reason is not None:
                tail = detok.flush()
                shown, matched = matcher.feed(tail)
                update.text += shown
                if matched is not None:
                    update.finish_reason, update.stop_reason = "stop", matched
                else:
                    update.text += matcher.flush()
                    update.finish_reason = delta.finish_reason
                    last = delta.token_ids[-1] if delta.token_ids else None
                    if delta.finish_reason == "stop" and last in stop_ids:
                        update.stop_reason = last
            self._record(state, update)
            if update.text or update.tokens or update.finish_reason:
                self._events.put_nowait(update)
            if update.finish_reason is not None:
                return

    def _record(self, state: ChoiceState, update: ChoiceUpdate) -> None:
        state.text += update.text
        state.tokens.extend(update.tokens)
        self.metrics.generated(len(update.tokens))
        if update.finish_reason is not None:
            state.finish_reason, state.stop_reason = update.finish_reason, update.stop_reason
            m = self.metrics
            m.finished.labels(m.model, update.finish_reason).inc()
            m.prompt_tokens.labels(m.model).inc(state.num_prompt_tokens or len(state.spec.prompt_ids))
            m.cached_tokens.labels(m.model).inc(state.num_cached_tokens)
            m.e2e.labels(m.model).observe(time.monotonic() - self.arrival_mono)


def _internal(exc: Exception) -> YutuError:
    return YutuError(f"{type(exc).__name__}: {exc}", ErrorKind.INTERNAL)


def _sampling_dict(spec: ChoiceSpec) -> dict[str, object]:
    """The choice's SamplingParams as the wire carries them (every field: a test holds it)."""
    s = spec.sampling
    gate = s.grammar_after_thinking
    return {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "seed": s.seed,
        "max_tokens": s.max_tokens,
        "min_tokens": s.min_tokens,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "logprobs": s.logprobs,
        "prompt_logprobs": s.prompt_logprobs,
        "logit_bias": [list(pair) for pair in s.logit_bias],
        "repetition_penalty": s.repetition_penalty,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "grammar": s.grammar,
        "grammar_after_thinking": None if gate is None else list(gate),
        "allowed_token_ids": None if s.allowed_token_ids is None else list(s.allowed_token_ids),
        "bad_words": [list(word) for word in s.bad_words],
    }
