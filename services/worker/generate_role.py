"""The generate channel of a mixed worker or a decode instance.

Front ends (gateways) connect a dealer to our router (:class:`~yutu.rpc.StreamPeer`, plain TCP) and
multiplex requests by id; every reply goes back to the connection that sent the request. A request may carry work done elsewhere (see
:mod:`yutu.protocol.generate`): tokens already ``generated`` (streamed to the client), the ``kv``
handle of a prefill instance holding its prompt's KV (pulled, then released), or ``store_blocks``
to try from the KV store. Only new tokens are sent back. A request sent with ``await_kv`` (its
prompt still being prefilled elsewhere) is admitted at once and waits, its blocks taken, for the
KVReady that brings the first token and the prefill's handle: the pull starts on that message.

A front end that is gone (its connection closed), or that pinged and then went quiet past the
window its Pings declare (frozen: its TCP connection stays up), has its requests aborted so their
KV blocks are freed at once, each answered with an UNAVAILABLE RequestFailed in case it wakes up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from yutu.engine.engine import RequestOutput
from yutu.engine.sampling import SamplingParams
from yutu.errors import ErrorKind, YutuError
from yutu.kv.hashing import block_key_digests, salted_root
from yutu.liveness import Liveness
from yutu.protocol.codec import ProtocolError
from yutu.protocol.generate import (
    CHANNEL,
    AbortRequest,
    GenerateRequest,
    KVReady,
    Ping,
    Pong,
    RequestFailed,
    TokenDelta,
    TokenDeltas,
)
from yutu.protocol.prefill import KVHandle
from yutu.rpc import Sent, StreamPeer
from yutu.supervise import Supervisor

from services.worker.engine_loop import EngineFront
from services.worker.imports import Awaiting, FromPeer, FromStore, KVImports

log = logging.getLogger(__name__)

_FRONT_END_CHECK_S = 0.5  # how often front ends' heartbeats are judged (each declares its window)
_SHUTDOWN_LINGER_S = 1.0  # the last deltas still go out this long after the socket closes


class GenerateRole:
    def __init__(
        self,
        engine_loop: EngineFront,
        imports: KVImports,
        root_key: bytes,
        block_size: int,
        host: str,
        port: int,
        check_prompt: Callable[[Any], str | None],
        loops: Supervisor,
    ) -> None:
        self.engine_loop = engine_loop
        self.imports = imports
        self.root_key = root_key
        self.block_size = block_size
        self._check_prompt = check_prompt
        self._routes: dict[str, bytes] = {}  # request id -> front-end identity
        self._front_ends = Liveness[bytes](timeout_s=3.0)  # front ends that ping, by identity
        self._peer = StreamPeer.router(
            CHANNEL,
            {
                GenerateRequest: self._admit,
                KVReady: self._on_kv_ready,
                AbortRequest: self._on_abort,
                Ping: self._on_ping,
            },
            host,
            port,
            name="generate",
        )
        self.endpoint = self._peer.endpoint
        self.accepting = True
        loops.every("front-end-liveness", _FRONT_END_CHECK_S, self._check_front_ends)

    @property
    def in_flight(self) -> int:
        return len(self._routes)

    # -- requests --------------------------------------------------------------------------------

    def _admit(self, identity: bytes, msg: GenerateRequest) -> None:
        rid = msg.request_id
        if not self.accepting:
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
        problem = self._check_prompt(msg.prompt_token_ids)
        if problem is None and msg.generated:
            problem = self._check_prompt(msg.generated)
            problem = None if problem is None else "generated " + problem.removeprefix("prompt ")
        if problem is not None:
            self._fail(identity, rid, ErrorKind.INVALID_REQUEST, problem)
            return
        try:
            params = SamplingParams(**msg.sampling)
        except (TypeError, ValueError) as exc:
            self._fail(identity, rid, ErrorKind.INVALID_REQUEST, f"invalid sampling parameters: {exc}")
            return
        try:
            root = salted_root(self.root_key, msg.cache_salt)  # of the keys of its blocks
        except ValueError as exc:
            self._fail(identity, rid, ErrorKind.INVALID_REQUEST, str(exc))
            return
        if msg.await_kv is True:
            if msg.generated or msg.kv is not None:
                self._fail(
                    identity, rid, ErrorKind.INVALID_REQUEST, "await_kv comes with no generated tokens or kv"
                )
                return
            prompt = msg.prompt_token_ids
            self.imports.expect(rid, Awaiting(len(prompt), self._pulled_keys(root, prompt, len(prompt))))
            self._routes[rid] = identity
            self.engine_loop.add(
                rid, prompt, params, import_tokens=len(prompt), await_token=True, cache_salt=msg.cache_salt,
                priority=msg.priority,
            )  # fmt: skip
            return
        try:
            # A prompt whose logprobs are asked is computed whole: the store's blocks are not tried.
            import_tokens = (
                0
                if params.prompt_logprobs is not None and msg.kv is None
                else self._plan_import(rid, msg, root)
            )
        except ProtocolError as exc:
            self._fail(identity, rid, ErrorKind.INVALID_REQUEST, f"malformed KV handle: {exc}")
            return
        self._routes[rid] = identity
        self.engine_loop.add(
            rid, msg.prompt_token_ids, params, generated=tuple(msg.generated), import_tokens=import_tokens,
            cache_salt=msg.cache_salt, priority=msg.priority,
        )  # fmt: skip

    def _on_kv_ready(self, identity: bytes, msg: KVReady) -> None:
        """The prefill of a request admitted with ``await_kv`` ended: pull its KV now."""
        rid = msg.request_id
        try:
            handle = KVHandle.from_wire(msg.kv)
        except ProtocolError as exc:
            if self._routes.get(rid) == identity:
                self._abort(rid)
                self._fail(identity, rid, ErrorKind.INVALID_REQUEST, f"malformed KV handle: {exc}")
            return
        if self._routes.get(rid) != identity:  # aborted meanwhile (or not this front end's request)
            self.imports.release(handle)
            return
        awaited = self.imports.awaited_tokens(rid)
        problem = None
        if type(msg.token) is not int or self._check_prompt([msg.token]) is not None:
            problem = f"token {msg.token!r} is not a token id of this model"
        elif awaited is None:
            problem = "the request awaits no KV (it was not sent with await_kv, or KVReady came twice)"
        elif handle.num_tokens != awaited:
            problem = f"the KV handle holds {handle.num_tokens} tokens, the prompt has {awaited}"
        if problem is not None:
            self._abort(rid)
            self.imports.release(handle)
            self._fail(identity, rid, ErrorKind.INVALID_REQUEST, f"KVReady for {rid}: {problem}")
            return
        self.imports.ready(rid, handle, msg.token)

    def _plan_import(self, rid: str, msg: GenerateRequest, root: bytes) -> int:
        """Where the request's leading KV comes from (told to the importer); returns its tokens.
        ``root``: of its blocks' keys."""
        tokens = msg.prompt_token_ids + list(msg.generated)
        if msg.kv is not None:
            handle = KVHandle.from_wire(msg.kv)
            num_tokens = min(handle.num_tokens, len(tokens) - 1)
            self.imports.expect(rid, FromPeer(handle, self._pulled_keys(root, tokens, num_tokens)))
            return num_tokens
        usable = (
            min(msg.store_blocks, (len(tokens) - 1) // self.block_size)
            if type(msg.store_blocks) is int
            else 0
        )
        if usable <= 0 or self.imports.store is None:
            return 0
        self.imports.expect(rid, FromStore(self._keys(root, tokens, usable)))
        return usable * self.block_size

    def _pulled_keys(self, root: bytes, tokens: list[int], num_tokens: int) -> list[str]:
        """The keys of the full blocks of ``tokens[:num_tokens]`` pulled from a prefill instance,
        which write-behind must not write again (none without write-behind)."""
        if self.imports.write_behind is None:
            return []
        return self._keys(root, tokens, num_tokens // self.block_size)

    def _keys(self, root: bytes, tokens: list[int], blocks: int) -> list[str]:
        """The hex keys, chained from ``root``, of the first ``blocks`` full blocks of ``tokens``."""
        return [k.hex() for k in block_key_digests(root, tokens[: blocks * self.block_size], self.block_size)]

    def _on_abort(self, identity: bytes, msg: AbortRequest) -> None:
        if self._routes.get(msg.request_id) == identity:  # only the front end that sent it
            self._abort(msg.request_id)

    def _abort(self, request_id: str) -> None:
        if self._routes.pop(request_id, None) is not None:
            self.engine_loop.abort(request_id)
            self.imports.drop(request_id)

    # -- from the engine -------------------------------------------------------------------------

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """One engine step's outputs: one frame per front end (TokenDeltas when it has several)."""
        by_front_end: dict[bytes, list[TokenDelta]] = {}
        for out in outputs:
            identity = self._routes.get(out.request_id)
            if identity is None:
                continue  # aborted by its front end meanwhile
            by_front_end.setdefault(identity, []).append(self._delta(out))
            if out.finished:
                del self._routes[out.request_id]
        for identity, deltas in by_front_end.items():
            if len(deltas) == 1:
                self._send(identity, deltas[0])
            elif self._peer_send(identity, TokenDeltas.of(deltas)) is Sent.UNROUTABLE:
                for delta in deltas:
                    self._abort(delta.request_id)
                log.info("front end of %d requests is gone; aborted them", len(deltas))

    def _delta(self, out: RequestOutput) -> TokenDelta:
        logprobs = None
        if out.new_logprobs is not None:
            logprobs = [lp.to_wire() for lp in out.new_logprobs]
        prompt_logprobs = None
        if out.prompt_logprobs is not None:
            prompt_logprobs = [None if lp is None else lp.to_wire() for lp in out.prompt_logprobs]
        return TokenDelta(
            request_id=out.request_id,
            token_ids=list(out.new_token_ids),
            logprobs=logprobs,
            finish_reason=out.finish_reason.value if out.finish_reason is not None else None,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def on_error(self, request_id: str, error: YutuError) -> None:
        front_end = self._routes.pop(request_id, None)
        if front_end is not None:
            self._fail(front_end, request_id, error.kind, str(error))

    def fail_all(self, error: YutuError) -> None:
        for rid, identity in list(self._routes.items()):
            self._fail(identity, rid, error.kind, str(error))
        self._routes.clear()

    # -- liveness --------------------------------------------------------------------------------

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

    # -- sending ---------------------------------------------------------------------------------

    def _fail(self, identity: bytes, request_id: str, kind: ErrorKind, message: str) -> None:
        self._send(identity, RequestFailed(request_id, kind.value, message))

    def _send(self, identity: bytes, msg: TokenDelta | RequestFailed) -> None:
        """Send a reply about a request; if its front end is gone, abort the request (frees its blocks)."""
        if self._peer_send(identity, msg) is Sent.UNROUTABLE:
            self._abort(msg.request_id)
            log.info("front end of %s is gone; aborted it", msg.request_id)

    def _peer_send(self, identity: bytes, msg: Any) -> Sent:
        return self._peer.send(msg, to=identity)

    def close(self) -> None:
        self.accepting = False
        self._peer.close(_SHUTDOWN_LINGER_S)
