"""The prefill role: first tokens and KV handles on the prefill channel.

    PrefillRequest -> reuse the local prefix, fetch the planned store blocks into the KV cache
                      (FromStore import), compute the rest (chunked prefill), sample the first token
                   <- PrefillResult: the token + a KVHandle; the blocks stay held under a lease
    ReleaseKV      -> the decode pulled them (or the gateway gave up): free them; a request still
                      prefilling is aborted
    RenewKV        -> the lease restarts

Every hold ends exactly once: released, expired (the decode never came), undelivered (its result
could not be sent: the gateway's connection was gone), or at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from yutu.engine.engine import RequestOutput
from yutu.engine.sampling import SamplingParams
from yutu.errors import ErrorKind, YutuError
from yutu.kv.hashing import block_key_digests, salted_root
from yutu.protocol import prefill as p
from yutu.rpc import RpcServer
from yutu.rpc.stream import StreamRpcServer
from yutu.worker.holds import Holds
from yutu.worker.kv_region import KVRegion

from services.worker.engine_loop import EngineFront
from services.worker.imports import FromStore, KVImports

log = logging.getLogger(__name__)


class PrefillRole:
    def __init__(
        self,
        engine_loop: EngineFront,
        imports: KVImports,
        region: KVRegion,
        instance_id: str,
        root_key: bytes,
        block_size: int,
        lease_s: float,
        host: str,
        port: int,
        advertise_host: str,
        check: Callable[[Any], str | None],  # prompt ids -> what is wrong with them, or None
    ) -> None:
        self.engine_loop = engine_loop
        self.imports = imports
        self.region = region
        self.instance_id = instance_id
        self.root_key = root_key
        self.block_size = block_size
        self._check = check
        self.holds = Holds(lease_s, engine_loop.release)
        self._pending: dict[str, asyncio.Future[p.PrefillResult]] = {}
        self.server = RpcServer(p.CHANNEL, self._handle, host, port)
        self.endpoint = self.server.endpoint.replace(host, advertise_host, 1)
        # The same channel over a plain TCP stream (any free port), what gateways use: no ZeroMQ
        # I/O-thread wake-ups on the prefill request and its result. The ZeroMQ one stays (the
        # reference, and the control endpoint decode instances release holds on).
        self.stream = StreamRpcServer(p.CHANNEL, self._handle, host, 0, on_undelivered=self._undelivered)
        self.stream_endpoint = ""
        self._hosts = (host, advertise_host)
        self.accepting = True
        self.prefilled = 0

    async def start(self) -> None:
        self.server.start()
        await self.stream.start()
        self.stream_endpoint = self.stream.endpoint.replace(*self._hosts, 1)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # -- the channel --------------------------------------------------------------------------------

    def _handle(self, msg: Any) -> Any:
        if isinstance(msg, p.PrefillRequest):
            return self._prefill(msg)
        if isinstance(msg, p.ReleaseKV):
            return p.Released(msg.request_id, self.release(msg.request_id))
        if isinstance(msg, p.RenewKV):
            return p.Released(msg.request_id, self.holds.renew(msg.request_id, time.monotonic()))
        if isinstance(msg, p.Ping):
            return p.Pong(msg.seq, len(self._pending), len(self.holds))
        raise YutuError(f"unexpected {type(msg).__name__} on the prefill channel", ErrorKind.INVALID_REQUEST)

    def _prefill(self, msg: p.PrefillRequest) -> asyncio.Future[p.PrefillResult]:
        rid = msg.request_id
        if not self.accepting:
            raise YutuError("prefill instance is shutting down; retry on another one", ErrorKind.UNAVAILABLE)
        if not isinstance(rid, str) or not rid or rid in self._pending or rid in self.holds:
            raise YutuError(f"request id {rid!r} is empty or already in use", ErrorKind.INVALID_REQUEST)
        problem = self._check(msg.prompt_token_ids)
        if problem is not None:
            raise YutuError(problem, ErrorKind.INVALID_REQUEST)
        try:
            params = SamplingParams(**msg.sampling)
        except (TypeError, ValueError) as exc:
            raise YutuError(f"invalid sampling parameters: {exc}", ErrorKind.INVALID_REQUEST) from None
        try:
            root = salted_root(self.root_key, msg.cache_salt)
        except ValueError as exc:
            raise YutuError(str(exc), ErrorKind.INVALID_REQUEST) from None
        ids = msg.prompt_token_ids
        import_tokens = 0
        if self.imports.store is not None and type(msg.store_blocks) is int and msg.store_blocks > 0:
            usable = min(msg.store_blocks, (len(ids) - 1) // self.block_size)
            if usable > 0:
                keys = [
                    k.hex() for k in block_key_digests(root, ids[: usable * self.block_size], self.block_size)
                ]
                self.imports.expect(rid, FromStore(keys))
                import_tokens = usable * self.block_size
        future: asyncio.Future[p.PrefillResult] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        self.engine_loop.add(
            rid, ids, params, import_tokens=import_tokens, prefill_only=True, cache_salt=msg.cache_salt,
            priority=msg.priority,
        )  # fmt: skip
        return future

    def _undelivered(self, reply: Any) -> None:
        """A result whose gateway's connection was gone when it came: its KV hold goes at once."""
        if (
            isinstance(reply, p.PrefillResult)
            and reply.kv is not None
            and self.holds.undeliverable(reply.request_id)
        ):
            log.warning(
                "KV hold of %s released: its result could not be sent (the gateway is gone)", reply.request_id
            )

    def release(self, request_id: str) -> bool:
        """Free a hold, or abort a request still prefilling (its caller gave up); False: nothing held."""
        future = self._pending.pop(request_id, None)
        if future is not None:
            self.engine_loop.abort(request_id)
            if not future.done():
                future.set_exception(
                    YutuError(f"request {request_id} was released while prefilling", ErrorKind.UNAVAILABLE)
                )
            return True
        return self.holds.release(request_id)

    # -- from the engine ----------------------------------------------------------------------------

    def on_output(self, out: RequestOutput) -> None:
        future = self._pending.pop(out.request_id, None)
        if future is None or future.done():
            if out.kv_held is not None:  # released meanwhile: nobody will pull it
                self.engine_loop.release(out.request_id)
            return
        logprobs = None
        if out.new_logprobs:
            logprobs = out.new_logprobs[0].to_wire()
        handle = None
        if out.kv_held is not None:
            hold = self.holds.add(
                out.request_id, out.kv_held.block_ids, out.kv_held.num_tokens, time.monotonic()
            )
            handle = p.KVHandle(
                self.instance_id, out.request_id, self.endpoint, self.imports.transfer.segment_name,
                self.region.name, hold.block_ids, hold.num_tokens, self.region.block_bytes, self.holds.lease_s,
                self.imports.kv_salt,
            ).to_wire()  # fmt: skip
        self.prefilled += 1
        future.set_result(
            p.PrefillResult(
                out.request_id,
                out.new_token_ids[0],
                logprobs,
                None if out.finish_reason is None else out.finish_reason.value,
                out.num_prompt_tokens,
                out.num_cached_tokens,
                handle,
            )
        )

    def on_error(self, request_id: str, error: YutuError) -> bool:
        """A request failed in the engine; True if it was one of ours."""
        self.imports.forget(request_id)
        future = self._pending.pop(request_id, None)
        if future is None:
            return False
        if not future.done():
            future.set_exception(error)
        return True

    def fail_all(self, error: YutuError) -> None:
        for request_id in list(self._pending):
            self.on_error(request_id, error)

    def expire(self) -> None:
        """Release holds whose lease ran out (their decode never came)."""
        for request_id in self.holds.expire(time.monotonic()):
            log.warning(
                "KV hold of %s expired after %.0fs: no decode pulled it", request_id, self.holds.lease_s
            )

    async def close(self) -> None:
        self.accepting = False
        self.fail_all(
            YutuError("prefill instance is shutting down; retry the request", ErrorKind.UNAVAILABLE)
        )
        self.holds.release_all()
        await self.server.close()
        await self.stream.close()
