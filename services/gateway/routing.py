"""Where each choice runs, and the disaggregated request path.

A :class:`Router` does two things for every choice: ``place`` (decide the instances: may raise a
429 or 503 before anything runs, so the HTTP status and the ``x-yutu-*`` headers are known before
a response starts) and ``start`` (run it; the returned handle yields TokenDeltas like a worker's).

- :class:`MixedRouter`: one mixed worker does everything (``yutu up --workers K``).
- :class:`DisaggRouter`: the conductor places the request (``Place``); the prefill instance
  computes the first token and holds the KV; the gateway streams that token at once and hands the
  request with the KV handle to the decode instance, which pulls the blocks and streams the rest::

      place ----> conductor: Placement (prefill p | none, decode d, store_blocks)
      prefill --> p: PrefillRequest            <- PrefillResult (first token, KV handle)
      decode ---> d: GenerateRequest(await_kv)    (at the same time: d admits it, takes its blocks)
      first token to the client
      decode ---> d: KVReady(first, handle)    <- TokenDelta* (d pulls at once, releases p's hold)

  Telling the decode instance while the prefill runs takes the decode's admission (a round trip
  through its engine, a step on a busy instance) off the path from the first token to the second.
  A prefill that fails or whose first token ends the request aborts the decode's admission.

  Failures: a prefill instance lost mid-prefill -> the request is placed again without it (or
  fails with a clear 503 when none is left). A decode instance lost mid-stream -> the request moves
  to another decode instance with every token streamed so far (``generated``); it fetches the
  prompt's and generated blocks from the store and recomputes only what is missing, so the client's
  stream goes on with no token duplicated or missing. When no other decode instance is usable, the
  stream waits up to ``failover_wait_s`` (``--failover-wait``) for one to come (the lost one
  restarted by ``yutu up``, a few seconds later) before it ends with the 503. A mixed worker lost
  mid-stream is handled alike (:class:`MixedHandle`). While the conductor is unreachable the
  gateway places requests itself (least loaded) and counts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Protocol

from yutu.errors import ErrorKind, OverloadedError, YutuError
from yutu.kv.hashing import block_key_digests, root_key, salted_root
from yutu.protocol import conductor as c
from yutu.protocol import prefill as p
from yutu.protocol.generate import GenerateRequest, TokenDelta

from services.gateway.conductor_client import ConductorClient
from services.gateway.metrics import GatewayMetrics
from services.gateway.prefill_pool import PrefillClient, PrefillPool
from services.gateway.workers import GenerationHandle, WorkerClient, WorkerPool

log = logging.getLogger(__name__)

MAX_PREFILL_ATTEMPTS = 3  # placements of one request after prefill instances failed it
MAX_MIGRATIONS = 3  # decode instances one request may move through


@dataclass(frozen=True)
class Route:
    """Where one choice runs: ``prefill`` None means the decode instance (or mixed worker) prefills."""

    prefill: str | None
    decode: str
    store_blocks: int = 0  # leading blocks to take from the KV store
    by_conductor: bool = False


def instance_headers(routes: list[Route]) -> dict[str, str]:
    """``x-yutu-prefill`` / ``x-yutu-decode``: the instances serving a response (its first choices;
    the prefill header says ``none`` where the decode instance or a mixed worker prefilled)."""
    if not routes:
        return {}
    prefills = dict.fromkeys(r.prefill or "none" for r in routes)
    decodes = dict.fromkeys(r.decode for r in routes)
    return {"x-yutu-prefill": ",".join(prefills), "x-yutu-decode": ",".join(decodes)}


def routed_headers(headers: Any) -> dict[str, str]:
    """The ``instance_headers`` among a response's ``headers`` (to carry onto another response)."""
    return {k: v for k, v in headers.items() if k.startswith("x-yutu-")}


class Handle(Protocol):
    async def next(self) -> TokenDelta: ...

    def close(self) -> None: ...


class Router(Protocol):
    async def place(self, request: GenerateRequest) -> Route: ...

    def start(self, request: GenerateRequest, route: Route) -> Handle: ...


def _not_moved(loss: YutuError, none: YutuError) -> YutuError:
    """The error of a stream whose worker lost it and that no other worker could take over."""
    return YutuError(f"{loss}; it could not be moved: {none}", none.kind)


def _moved(request: GenerateRequest, move: int, tokens: list[int], **changes: Any) -> GenerateRequest:
    """``request`` as sent on its ``move``-th move (0: its first placement) with every token streamed
    so far: the new worker computes their KV and goes on after them. A moved request has an id of
    its own (``-mN``): ids in flight are unique per worker, and the lost one may still be known
    where it ran."""
    suffix = f"-m{move}" if move else ""
    if tokens and request.sampling.get("prompt_logprobs") is not None:  # they went out with the first token
        changes.setdefault("sampling", {**request.sampling, "prompt_logprobs": None})
    return replace(request, request_id=request.request_id + suffix, generated=list(tokens), **changes)


def _log_loss(what: str, worker: WorkerClient, request: GenerateRequest, tokens: int, exc: YutuError) -> None:
    log.warning(
        "%s %s lost request %s after %d token(s) (%s): moving it",
        what, worker.info.instance_id, request.request_id, tokens, exc,
    )  # fmt: skip


class MixedRouter:
    """Every choice on one mixed worker, the least loaded."""

    def __init__(self, pool: WorkerPool, metrics: GatewayMetrics, failover_wait_s: float = 30.0) -> None:
        self.pool = pool
        self.metrics = metrics
        self.failover_wait_s = failover_wait_s

    async def place(self, request: GenerateRequest) -> Route:
        return Route(None, self.pool.pick().info.instance_id)

    def start(self, request: GenerateRequest, route: Route) -> Handle:
        worker = self.pool.workers.get(route.decode)
        if worker is None or not worker.usable:
            worker = self.pool.pick()
        return MixedHandle(self, request, worker.submit(request))


class MixedHandle:
    """One choice on a mixed worker. A worker lost mid-stream (503) hands the choice to another
    -- or to the same instance restarted, waiting up to ``failover_wait_s`` for one -- with every
    token streamed so far (``generated``): the new worker computes the KV of the prompt and those
    tokens (from its prefix cache and the store where it can) and goes on, so the client's stream
    has no token duplicated or missing. Other errors end the stream as before."""

    def __init__(self, router: MixedRouter, request: GenerateRequest, handle: GenerationHandle) -> None:
        self.router = router
        self.request = request
        self.tokens: list[int] = []  # every token streamed so far
        self._handle = handle
        self._lost: set[WorkerClient] = set()
        self._moves = 0
        self._closed = False

    async def next(self) -> TokenDelta:
        while True:
            try:
                delta = await self._handle.next()
            except YutuError as exc:
                if exc.kind is not ErrorKind.UNAVAILABLE or self._moves == MAX_MIGRATIONS or self._closed:
                    raise
                await self._move(exc)
                continue
            self.tokens.extend(delta.token_ids)
            return delta if self._moves == 0 else replace(delta, request_id=self.request.request_id)

    async def _move(self, exc: YutuError) -> None:
        lost = self._handle.worker
        self._handle.close()
        self._lost.add(lost)
        self.router.metrics.migrations.labels(self.router.metrics.model).inc()
        _log_loss("worker", lost, self.request, len(self.tokens), exc)
        try:
            worker = await self.router.pool.pick_within(self.router.failover_wait_s, self._lost)
        except YutuError as none:
            raise _not_moved(exc, none) from None
        self._moves += 1
        self._handle = worker.submit(_moved(self.request, self._moves, self.tokens))

    def close(self) -> None:
        self._closed = True
        self._handle.close()


@lru_cache(maxsize=8)
def _root_key(salt: str) -> bytes:
    return root_key(salt)


@dataclass
class DisaggRouter:
    decodes: WorkerPool
    prefills: PrefillPool
    conductor: ConductorClient
    default_salt: str  # the salt of workers that do not advertise theirs (the model directory's name)
    metrics: GatewayMetrics
    failover_wait_s: float = 30.0  # how long a stream whose decode was lost waits for another (none usable)
    handles: set[DisaggHandle] = field(default_factory=set)

    @property
    def block_size(self) -> int:
        """The decode instances' block size (every instance of a deployment must use the same)."""
        sizes = {w.info.block_size for w in self.decodes.workers.values()}
        if len(sizes) > 1:
            raise YutuError(
                f"decode instances disagree on the KV block size {sorted(sizes)}: restart them alike",
                ErrorKind.INTERNAL,
            )
        return sizes.pop() if sizes else 16

    @property
    def root_key(self) -> bytes:
        """The root of the block keys, from the salt the decode instances advertise (model and dtype:
        keys must be the ones the engines compute, or no prefix is ever found)."""
        salts = {w.info.kv_salt or self.default_salt for w in self.decodes.workers.values()}
        if len(salts) > 1:
            raise YutuError(
                f"decode instances disagree on the KV salt {sorted(salts)} (model or --dtype): restart them alike",
                ErrorKind.INTERNAL,
            )
        return _root_key(salts.pop() if salts else self.default_salt)

    def keys(self, token_ids: list[int], cache_salt: str | None = None) -> list[str]:
        """The keys of the full blocks of ``token_ids``, as the engines key them (salted apart)."""
        root = salted_root(self.root_key, cache_salt)
        return [k.hex() for k in block_key_digests(root, token_ids, self.block_size)]

    async def place(self, request: GenerateRequest, exclude: frozenset[str] = frozenset()) -> Route:
        """Ask the conductor; place here (least loaded) when it cannot answer. Raises 429/503.

        A request scoring its prompt (``prompt_logprobs``: echo with logprobs) computes it whole on
        one engine, no prefill instance and no reused KV: it goes to the least loaded decode
        instance, which prefills it, without the conductor (whose placements are of reused KV)."""
        if request.sampling.get("prompt_logprobs") is not None:
            return Route(None, self.decodes.pick().info.instance_id, 0)
        keys = self.keys(request.prompt_token_ids, request.cache_salt)
        max_tokens = int(request.sampling.get("max_tokens", 16))
        waited = max(0.0, time.time() - request.arrival_time)  # a busy gateway's delay counts in the TTFT
        msg = c.Place(
            request.request_id,
            keys,
            len(request.prompt_token_ids),
            max_tokens,
            sorted(exclude),
            waited,
            request.priority,
        )
        reply = await self.conductor.place(msg)
        if isinstance(reply, c.Rejected):
            kind = ErrorKind(reply.kind)
            if kind is ErrorKind.OVERLOADED:
                self.metrics.rejected.labels(self.metrics.model).inc()
                raise OverloadedError(
                    f"the service is overloaded: {reply.message}; retry later", reply.retry_after_s
                )
            raise YutuError(f"no instance can take the request: {reply.message}", kind)
        if reply is not None:
            return Route(reply.prefill, reply.decode, reply.store_blocks, by_conductor=True)
        self.metrics.conductor_fallbacks.labels(self.metrics.model).inc()
        prefill = self.prefills.pick(exclude)
        decode = self.decodes.pick()
        return Route(None if prefill is None else prefill.instance_id, decode.info.instance_id, len(keys))

    def start(self, request: GenerateRequest, route: Route) -> Handle:
        handle = DisaggHandle(self, request, route)
        self.handles.add(handle)
        handle.task.add_done_callback(lambda _: self.handles.discard(handle))
        return handle


class DisaggHandle:
    """One choice on the disaggregated path; ``next()`` yields its deltas like a worker's handle."""

    def __init__(self, router: DisaggRouter, request: GenerateRequest, route: Route) -> None:
        self.router = router
        self.request = request
        self.route = route
        self.tokens: list[int] = []  # every token streamed to the client so far
        self.cached_tokens = 0
        self.prefill_time_s: float | None = None
        self._handed_at: float | None = None  # monotonic: the prefill's result came (handoff starts)
        self._queue: asyncio.Queue[TokenDelta | YutuError] = asyncio.Queue()
        self._prefill: PrefillClient | None = None  # while a prefill may be running or holding KV
        self._decode: GenerationHandle | None = None
        self._closed = False
        self.task = asyncio.create_task(self._run(), name=f"disagg-{request.request_id}")

    async def next(self) -> TokenDelta:
        reply = await self._queue.get()
        if isinstance(reply, YutuError):
            raise reply
        return reply

    def close(self) -> None:
        """Stop the choice wherever it is: abort the decode, drop the prefill's request or hold;
        tell the conductor it ended (however it ended), so it stops counting it."""
        if self._closed:
            return
        self._closed = True
        self.task.cancel()
        self.router.conductor.finished(self.request.request_id)
        if self._decode is not None:
            self._decode.close()
        if self._prefill is not None:
            self._prefill.release(self.request.request_id)
            self._prefill = None

    async def _run(self) -> None:
        try:
            ended, kv = await self._prefill_phase()
            if not ended:
                await self._decode_phase(kv)
        except YutuError as exc:
            self._queue.put_nowait(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced as a 500, never a hang
            log.exception("disaggregated request %s failed", self.request.request_id)
            self._queue.put_nowait(YutuError(f"{type(exc).__name__}: {exc}", ErrorKind.INTERNAL))

    async def _prefill_phase(self) -> tuple[bool, list[Any] | None]:
        """Run the prefill; returns (the first token ended the request, the KV handle in wire form
        -- None when there was no prefill instance: the decode prefills)."""
        route, exclude = self.route, set[str]()
        for attempt in range(MAX_PREFILL_ATTEMPTS):
            prefill_id = route.prefill
            if prefill_id is None:
                self.route = route  # the decode instance prefills (perhaps after a re-placement)
                return False, None
            client = self.router.prefills.get(prefill_id)
            if client is None:
                exclude.add(prefill_id)
                route = await self.router.place(self.request, frozenset(exclude))
                continue
            req = self.request
            msg = p.PrefillRequest(
                req.request_id, req.prompt_token_ids, req.sampling, route.store_blocks, req.arrival_time,
                req.cache_salt, req.priority,
            )  # fmt: skip
            self._prefill = client
            self._tell_decode(route.decode, attempt)
            try:
                result: p.PrefillResult = await client.call(msg)
            except YutuError as exc:
                self._prefill = None
                client.release(req.request_id)  # a frozen instance that wakes up drops it (best effort)
                self._untell_decode()
                if exc.kind is not ErrorKind.UNAVAILABLE:
                    raise
                log.warning(
                    "prefill of %s on %s failed (%s): placing it again", req.request_id, prefill_id, exc
                )
                exclude.add(prefill_id)
                route = await self.router.place(self.request, frozenset(exclude))
                continue
            self.route = route
            self._first_token(result)
            if result.finish_reason is not None:
                self._prefill = None
                self._untell_decode()
                return True, None
            return False, result.kv
        raise YutuError(
            f"request {self.request.request_id} failed on {MAX_PREFILL_ATTEMPTS} prefill instances: retry later",
            ErrorKind.UNAVAILABLE,
        )

    def _tell_decode(self, decode: str, attempt: int) -> None:
        """Admit the request on its decode instance now, while the prefill runs (``await_kv``), so
        its blocks are taken when the first token comes and the pull starts on KVReady. Not where
        the first token is the last, nor on a decode instance not usable now (the decode phase
        picks one then, as without this). Each prefill attempt tells the decode under its own id
        (the one an earlier attempt aborted may still be on its way out there)."""
        worker = self.router.decodes.workers.get(decode)
        if int(self.request.sampling.get("max_tokens", 16)) < 2 or worker is None or not worker.usable:
            return
        request_id = self.request.request_id + ("" if attempt == 0 else f"-p{attempt}")
        try:
            self._decode = worker.submit(
                replace(self.request, request_id=request_id, await_kv=True, store_blocks=0)
            )
        except YutuError:
            log.info("could not tell decode instance %s of %s early", decode, self.request.request_id)

    def _untell_decode(self) -> None:
        if self._decode is not None:
            self._decode.close()
            self._decode = None

    def _first_token(self, result: p.PrefillResult) -> None:
        self._handed_at = time.monotonic()
        self.tokens.append(result.token_id)
        self.cached_tokens = result.num_cached_tokens
        self.prefill_time_s = time.time() - self.request.arrival_time
        self._queue.put_nowait(
            TokenDelta(
                self.request.request_id,
                [result.token_id],
                None if result.logprobs is None else [result.logprobs],
                result.finish_reason,
                result.num_prompt_tokens,
                result.num_cached_tokens,
            )
        )
        self.router.conductor.observed(
            c.Observed(
                self.request.request_id,
                self.prefill_time_s,
                self.route.prefill,
                self.route.decode,
                self.cached_tokens,
            )
        )

    async def _decode_phase(self, kv: list[Any] | None) -> None:
        route, lost = self.route, set[WorkerClient]()  # connections that lost this request
        loss: YutuError | None = None  # how the last one lost it
        for attempt in range(MAX_MIGRATIONS + 1):
            decode = self._decode if attempt == 0 else None
            if decode is not None and kv is not None:  # admitted while the prefill ran: hand it the KV
                decode.kv_ready(self.tokens[0], kv)
            else:
                self._untell_decode()  # the decode instance prefills after all: told of nothing
                try:
                    decode = self._decode = await self._submit_decode(attempt, route, lost, kv)
                except YutuError as none:
                    raise none if loss is None else _not_moved(loss, none) from None
            worker = decode.worker
            self.route = replace(self.route, decode=worker.info.instance_id)
            self._prefill = None  # the decode releases the hold it pulls; a hold it never pulls expires
            kv = None  # a migrated request takes its KV from the store
            try:
                while True:
                    delta = await decode.next()
                    self._deliver(delta)
                    if delta.finish_reason is not None:
                        return
            except YutuError as exc:
                if exc.kind is not ErrorKind.UNAVAILABLE or attempt == MAX_MIGRATIONS or self._closed:
                    raise
                lost.add(worker)
                loss = exc
                self.router.metrics.migrations.labels(self.router.metrics.model).inc()
                _log_loss("decode instance", worker, self.request, len(self.tokens), exc)
                route = Route(None, worker.info.instance_id)  # not that one again
            finally:
                decode.close()
                self._decode = None

    async def _submit_decode(
        self, attempt: int, route: Route, lost: set[WorkerClient], kv: list[Any] | None
    ) -> GenerationHandle:
        """Send the request, with every token so far, to ``route``'s decode instance (another when
        that one is unusable or lost it before; when none is usable, the first to come within the
        failover wait, else the 503)."""
        worker = self.router.decodes.workers.get(route.decode)
        if worker is None or not worker.usable or worker in lost:
            worker = await self.router.decodes.pick_within(self.router.failover_wait_s, lost)
        store_blocks = (
            route.store_blocks
            if attempt == 0
            else len(self.router.keys(self.request.prompt_token_ids + self.tokens))
        )
        if kv is not None:
            store_blocks = 0  # the KV comes with the request
        return worker.submit(_moved(self.request, attempt, self.tokens, kv=kv, store_blocks=store_blocks))

    def _deliver(self, delta: TokenDelta) -> None:
        if self._handed_at is not None and delta.token_ids:
            m = self.router.metrics
            m.handoff.labels(m.model).observe(time.monotonic() - self._handed_at)
            self._handed_at = None
        if self.prefill_time_s is None and delta.token_ids:  # the decode prefilled it itself
            self.prefill_time_s = time.time() - self.request.arrival_time
            self.cached_tokens = delta.num_cached_tokens
            self.router.conductor.observed(
                c.Observed(
                    self.request.request_id, self.prefill_time_s, None, self.route.decode, self.cached_tokens
                )
            )
        self.tokens.extend(delta.token_ids)
        # one request id and the first placement's reuse, whatever decode instance streams it
        self._queue.put_nowait(
            replace(delta, request_id=self.request.request_id, num_cached_tokens=self.cached_tokens)
        )
