"""The worker service: an engine (mixed prefill + decode role) behind the generate channel.

Front ends (the gateway) connect a DEALER to our ROUTER and multiplex requests by id. A request's
replies go back to the identity that sent it. If that front end is gone (ZeroMQ cannot route to it),
the request is aborted so its KV blocks are freed at once; so are the requests of a front end that
pinged and then went quiet past the window its Pings declare (frozen: its TCP connection stays up),
each answered with an UNAVAILABLE RequestFailed in case it wakes up.

Registry record meta (refreshed every second, written on the next heartbeat): ``model``,
``model_dir``, ``max_model_len``, ``block_size``, ``demo``, the load (``num_running``,
``num_waiting``, ``kv_usage``) and ``broken``: None while the engine serves, else the reason it
cannot (see ``services.worker.engine_loop``: steps kept failing, or a failure outside a step). A
broken worker stays up so it can say so: ``/ready`` answers 503 naming the reason, requests in
flight fail with ``internal_error`` and new ones with ``service_unavailable``; front ends should
skip a worker whose ``broken`` is set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter
from yutu.engine.engine import EngineConfig, LLMEngine, RequestOutput
from yutu.engine.model_source import resolve_model, served_model_name
from yutu.engine.sampling import SamplingParams
from yutu.errors import ErrorKind, YutuError
from yutu.liveness import Liveness
from yutu.protocol.generate import (
    CHANNEL,
    AbortRequest,
    GenerateRequest,
    Ping,
    Pong,
    RequestFailed,
    TokenDelta,
)
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.rpc import Peer, Sent
from yutu.service import Service

from services.worker.engine_loop import EngineLoop
from services.worker.metrics import EngineCollector
from services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

_META_REFRESH_S = 1.0
_FRONT_END_CHECK_S = 0.5  # how often front ends' heartbeats are judged (each declares its window)
_SHUTDOWN_LINGER_S = 1.0  # the last deltas still go out this long after the socket closes


def error_kind(exc: BaseException) -> ErrorKind:
    """The kind of an engine input error (PromptTooLongError is a ValueError too)."""
    return ErrorKind.TOO_LARGE if type(exc).__name__ == "PromptTooLongError" else ErrorKind.INVALID_REQUEST


class WorkerService(Service):
    kind = "worker"

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__()
        self.settings = settings
        self.engine: LLMEngine | None = None
        self.model_dir: Path | None = None
        self.served_model_name = ""
        self.demo = False
        self._loop_engine: EngineLoop | None = None
        self._peer: Peer | None = None  # the generate channel's ROUTER
        self._routes: dict[str, bytes] = {}  # request id -> front-end identity
        self._front_ends = Liveness[bytes](timeout_s=3.0)  # front ends that ping, by identity
        self._registry: Registry | None = None
        self._registration: Registration | None = None
        self._accepting = False
        self.started_at = time.time()

    # -- lifecycle -------------------------------------------------------------------------------

    async def startup(self) -> None:
        s = self.settings
        if s.torch_threads > 0:
            torch.set_num_threads(s.torch_threads)
        self.model_dir = await asyncio.to_thread(resolve_model, s.model)
        config = EngineConfig(
            model_dir=self.model_dir,
            block_size=s.block_size,
            num_kv_blocks=s.num_kv_blocks,
            kv_cache_memory_bytes=s.kv_cache_memory_mib * 2**20,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=s.max_model_len,
            enable_prefix_caching=s.enable_prefix_caching,
        )
        log.info("loading model from %s", self.model_dir)
        self.engine = await asyncio.to_thread(LLMEngine, config)
        self.demo = bool(self.engine.model_config.yutu_demo)
        self.served_model_name = s.served_model_name or served_model_name(s.model, self.model_dir)
        if self.demo:
            log.warning(
                "serving the built-in demo model %r: random weights, its text is meaningless;"
                " serve a real checkpoint with --model /path/to/hf-dir",
                self.served_model_name,
            )
        self.metrics.register(EngineCollector(self))

        loop = asyncio.get_running_loop()
        self._loop_engine = EngineLoop(self.engine, loop, self._on_outputs, self._on_error)
        self._loop_engine.start()

        self._peer = Peer.router(
            CHANNEL,
            {GenerateRequest: self._admit, AbortRequest: self._on_abort, Ping: self._on_ping},
            s.host,
            s.zmq_port,
            name="generate",
        )
        endpoint = self._peer.endpoint.replace(s.host, s.advertise_host, 1)
        self._accepting = True
        self.loops.every("front-end-liveness", _FRONT_END_CHECK_S, self._check_front_ends)

        self._registry = Registry.from_url(s.redis_url, s.registry_prefix)
        record = ServiceRecord(
            kind=self.kind,
            instance_id=s.instance_id,
            endpoints={"generate": endpoint, "admin": self.http_url},
            meta=self._meta(),
        )
        self._registration = Registration(self._registry, record, s.registry_ttl_s, supervisor=self.loops)
        await self._registration.start()
        self.loops.every("worker-meta", _META_REFRESH_S, self._refresh_meta)
        log.info("worker %s serving %r on %s", s.instance_id, self.served_model_name, endpoint)

    async def drain(self) -> None:
        self._accepting = False
        if self._registration is not None:
            await self._registration.close()  # front ends stop picking us first
            self._registration = None
        # Polling is fine here: drain happens once, and it keeps the hot path free of bookkeeping.
        while self._routes:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    async def shutdown(self) -> None:
        self._accepting = False
        if self._registration is not None:
            await self._registration.close()
        if self._loop_engine is not None:
            await self._loop_engine.stop()
        if self._peer is not None:
            self._peer.close(_SHUTDOWN_LINGER_S)
        if self._registry is not None:
            await self._registry.close()

    def is_ready(self) -> bool:
        return self._accepting and self._loop_engine is not None and self._loop_engine.alive

    # -- generate channel ------------------------------------------------------------------------

    def _on_ping(self, identity: bytes, msg: Ping) -> None:
        """Answer at once; from its first Ping on, a front end silent past its window is given up on."""
        timeout_s = msg.timeout_s
        if type(timeout_s) not in (int, float) or not 0 < timeout_s < 3600:
            raise ValueError(f"ping with a liveness window of {timeout_s!r} s: expected (0, 3600)")
        self._front_ends.heard(identity, float(timeout_s))
        self._peer_send(identity, Pong(msg.seq))

    def _check_front_ends(self) -> None:
        """Abort the requests of front ends that stopped pinging (frozen or gone), freeing their blocks."""
        for silent in self._front_ends.expired():
            identity = silent.key
            self._front_ends.forget(identity)  # if it comes back, its next Ping watches it anew
            request_ids = [rid for rid, owner in self._routes.items() if owner == identity]
            log.warning(
                "front end %s sent no ping for %.1f s: aborting its %d request(s)",
                identity.hex(),
                silent.silence_s,
                len(request_ids),
            )
            for rid in request_ids:
                self._abort(rid)
                message = (
                    f"the worker heard no heartbeat from this front end for {silent.silence_s:.1f} s"
                    " and aborted the request: retry it"
                )
                self._peer_send(identity, RequestFailed(rid, ErrorKind.UNAVAILABLE.value, message))

    def _on_abort(self, identity: bytes, msg: AbortRequest) -> None:
        if self._routes.get(msg.request_id) == identity:  # only the front end that sent it
            self._abort(msg.request_id)

    def _admit(self, identity: bytes, msg: GenerateRequest) -> None:
        assert self._loop_engine is not None and self.engine is not None
        rid = msg.request_id
        if not self._accepting:
            self._fail(
                identity, rid, ErrorKind.UNAVAILABLE, "worker is shutting down; retry on another worker"
            )
            return
        if not isinstance(rid, str) or not rid or rid in self._routes:
            self._fail(
                identity,
                str(rid),
                ErrorKind.INVALID_REQUEST,
                f"request id {rid!r} is empty or already in use",
            )
            return
        vocab = self.engine.model_config.vocab_size
        ids = msg.prompt_token_ids
        if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < vocab for t in ids):
            self._fail(
                identity,
                rid,
                ErrorKind.INVALID_REQUEST,
                f"prompt must be a non-empty list of token ids in [0, {vocab})",
            )
            return
        try:
            params = SamplingParams(**msg.sampling)
        except (TypeError, ValueError) as exc:
            self._fail(identity, rid, ErrorKind.INVALID_REQUEST, f"invalid sampling parameters: {exc}")
            return
        self._routes[rid] = identity
        self._loop_engine.add(rid, ids, params)

    def _abort(self, request_id: str) -> None:
        if self._routes.pop(request_id, None) is not None and self._loop_engine is not None:
            self._loop_engine.abort(request_id)

    def _fail(self, identity: bytes, request_id: str, kind: ErrorKind, message: str) -> None:
        self._send(identity, RequestFailed(request_id, kind.value, message))

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Runs on the event loop: turn engine outputs into deltas for their front ends."""
        for out in outputs:
            identity = self._routes.get(out.request_id)
            if identity is None:
                continue  # aborted by its front end meanwhile
            logprobs = None
            if out.new_logprobs is not None:
                logprobs = [
                    [lp.token_id, lp.logprob, [list(alt) for alt in lp.top]] for lp in out.new_logprobs
                ]
            delta = TokenDelta(
                request_id=out.request_id,
                token_ids=list(out.new_token_ids),
                logprobs=logprobs,
                finish_reason=out.finish_reason.value if out.finish_reason is not None else None,
                num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens,
            )
            if out.finished:
                del self._routes[out.request_id]
            self._send(identity, delta)

    def _on_error(self, request_id: str, exc: BaseException) -> None:
        """A request failed (its kind from the error), or, with no id, the engine is broken."""
        if not request_id:  # broken: nothing in flight will finish; the worker stays up to say why
            for rid, identity in list(self._routes.items()):
                self._fail(identity, rid, ErrorKind.INTERNAL, f"worker engine failed: {exc}")
            self._routes.clear()
            if self._registration is not None:
                self._registration.update_meta(**self._meta())
            return
        front_end = self._routes.pop(request_id, None)
        if front_end is not None:
            kind = exc.kind if isinstance(exc, YutuError) else error_kind(exc)
            self._fail(front_end, request_id, kind, str(exc))

    @property
    def broken(self) -> str | None:
        """Why the engine cannot serve any more, or None (see the module docstring)."""
        return self._loop_engine.broken if self._loop_engine is not None else None

    def problems(self) -> list[str]:
        reasons = super().problems()
        if self.broken is not None:
            reasons.append(f"engine broken: {self.broken}")
        return reasons

    def _send(self, identity: bytes, msg: TokenDelta | RequestFailed) -> None:
        """Send a reply about a request; if its front end is gone, abort the request (frees its blocks)."""
        if self._peer_send(identity, msg) is Sent.UNROUTABLE:
            self._abort(msg.request_id)
            log.info("front end of %s is gone; aborted it", msg.request_id)

    def _peer_send(self, identity: bytes, msg: Any) -> Sent:
        if self._peer is None:
            return Sent.CLOSED
        return self._peer.send(msg, to=identity)

    # -- registry, admin -------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        assert self.engine is not None
        stats = self._loop_engine.stats if self._loop_engine is not None else self.engine.stats()
        return {
            "model": self.served_model_name,
            "model_dir": str(self.model_dir),
            "max_model_len": self.engine.max_model_len,
            "block_size": self.settings.block_size,
            "demo": self.demo,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_usage": stats.kv_usage,
            "broken": self.broken,
        }

    def _refresh_meta(self) -> None:
        """One step of the ``worker-meta`` loop: the next heartbeat writes the current load."""
        if self._registration is not None:
            self._registration.update_meta(**self._meta())

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"kind": self.kind, "instance_id": self.settings.instance_id}
        if self.engine is not None:
            stats = self._loop_engine.stats if self._loop_engine is not None else self.engine.stats()
            info |= {
                "model": self.served_model_name,
                "model_dir": str(self.model_dir),
                "demo": self.demo,
                "max_model_len": self.engine.max_model_len,
                "block_size": self.settings.block_size,
                "in_flight": len(self._routes),
                "broken": self.broken,
                "engine": asdict(stats),
                "uptime_s": round(time.time() - self.started_at, 3),
            }
        return info

    def admin_router(self) -> APIRouter:
        router = APIRouter()

        @router.post("/debug/check_integrity")
        async def check_integrity() -> dict[str, Any]:
            # Read-only check of the block manager's invariants; the result is a snapshot and may race
            # with a step, so tests call it only when the worker is idle.
            assert self.engine is not None
            self.engine.block_manager.check_integrity()
            return {"ok": True}

        return router
