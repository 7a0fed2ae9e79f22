"""The generate channel: a front end (the gateway) and an engine instance (mixed worker or decode).

Flow over one DEALER (front end) -> ROUTER (worker) connection::

    front end                         worker
    GenerateRequest  ------------->   admitted to the engine
                     <-------------   TokenDelta*  (new tokens, as they are sampled; TokenDeltas
                                                    carries one step's deltas of several requests)
                     <-------------   TokenDelta   (finish_reason set: the last one)
    AbortRequest     ------------->   request dropped, its KV blocks freed
                     <-------------   RequestFailed (instead of deltas, when it cannot run)

    Ping             ------------->   every ~1 s, whatever else is going on
                     <-------------   Pong (at once)

Every reply about a request (TokenDelta, RequestFailed) carries its id; the front end routes by it.

Disaggregation (version 3). A request may arrive with part of its work done elsewhere:
``generated`` holds tokens already streamed to the client (the prefill's first token; every token so
far when a request moves from a lost decode instance); ``kv`` is the KV handle of a prefill instance
holding the prompt's KV (:class:`yutu.protocol.prefill.KVHandle`, wire form): the worker pulls those
blocks and releases the hold; ``store_blocks`` says how many leading blocks the KV store may hold
(fetched past the worker's own prefix cache). Only new tokens come back as deltas.

Told early (version 6). A decode instance may get a request while its prompt is still being
prefilled elsewhere (``await_kv``): it admits it at once (blocks taken for the prompt's KV), and
the prefill's end comes as :class:`KVReady` (the first token and the KV handle), upon which it
pulls the blocks without first going through its engine; or as AbortRequest, when the prefill
failed or its first token ended the request::

    GenerateRequest(await_kv=True) -->   admitted, blocks taken, waiting
    KVReady(token, kv)             -->   pull now, release the prefill's hold, decode
                     <-------------   TokenDelta*  (the tokens after ``token``)

Liveness, both ways. The front end counts any message from a worker as a sign of life; a worker
silent for longer than the front end's window (a frozen or wedged process keeps its TCP connection
up) gets no new requests and its in-flight ones fail UNAVAILABLE, until it answers again. Each Ping
carries that window: a worker that hears no Ping from a front end for ``timeout_s`` aborts that
front end's requests (freeing their KV blocks) and tells it so with RequestFailed. Liveness is
opt-in: a front end that never pings (a test's raw socket) is never timed out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yutu.protocol.codec import Channel, ProtocolError

CHANNEL = Channel("generate", version=10)  # 2: Ping/Pong; 3: generated, kv, store_blocks; 4: TokenDeltas;
# 5: over plain TCP (yutu.rpc.StreamPeer), KV handles carry kv_salt; 6: await_kv, KVReady;
# 7: TokenDelta.prompt_logprobs; 8: a prompt_logprobs entry ends with its token's rank; 9: cache_salt;
# 10: priority


@CHANNEL.message("generate")
@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields (yutu.engine.sampling)
    arrival_time: float  # wall clock (time.time()) at the gateway
    generated: list[int] = field(default_factory=list)  # tokens already streamed (count as output)
    kv: list[Any] | None = None  # KVHandle.to_wire() of the prefill holding the prompt's KV
    store_blocks: int = 0  # leading blocks to try from the KV store (when kv is None)
    await_kv: bool = False  # the prompt is being prefilled elsewhere: KVReady follows (no generated, kv)
    cache_salt: str | None = None  # its blocks' keys are salted apart (yutu.kv.hashing.salted_root)
    priority: int = 0  # served before higher values, after lower ones (yutu.engine.scheduler)


@CHANNEL.message("kv_ready")
@dataclass
class KVReady:
    """The prefill of a request sent with ``await_kv`` ended with its first token (already streamed
    to the client); ``kv``: the KV handle of the prefill instance holding the prompt's KV."""

    request_id: str
    token: int
    kv: list[Any]


@CHANNEL.message("abort")
@dataclass
class AbortRequest:
    request_id: str


@CHANNEL.message("delta")
@dataclass
class TokenDelta:
    request_id: str
    token_ids: list[int]
    # One entry per token when logprobs were asked: [token_id, logprob, [[alt_id, alt_logprob], ...]]
    logprobs: list[list[Any]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; set on the last delta only
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache
    # With the first token, when the sampling asked for prompt_logprobs: one entry per prompt token,
    # the first None, the others as in ``logprobs`` followed by the token's rank in its row (1: the
    # most likely)
    prompt_logprobs: list[Any] | None = None


@CHANNEL.message("deltas")
@dataclass
class TokenDeltas:
    """One engine step's deltas for one front end (two or more requests): one frame instead of one
    per request. Each row is a TokenDelta's fields in order (``TokenDeltas.of`` / ``unpack``)."""

    rows: list[list[Any]]

    @classmethod
    def of(cls, deltas: list[TokenDelta]) -> TokenDeltas:
        return cls([[d.request_id, d.token_ids, d.logprobs, d.finish_reason, d.num_prompt_tokens,
                     d.num_cached_tokens, d.prompt_logprobs] for d in deltas])  # fmt: skip

    def unpack(self) -> list[TokenDelta]:
        """The deltas; raises ProtocolError for a row that is not a TokenDelta's seven fields."""
        out = []
        for row in self.rows:
            if not isinstance(row, list) or len(row) != 7 or not isinstance(row[0], str):
                raise ProtocolError(f"malformed TokenDeltas row: {row!r:.200}")
            out.append(TokenDelta(*row))
        return out


@CHANNEL.message("failed")
@dataclass
class RequestFailed:
    request_id: str
    kind: str  # a yutu.errors.ErrorKind value
    message: str


@CHANNEL.message("ping")
@dataclass
class Ping:
    seq: int  # counts up per front-end connection; echoed in the Pong
    timeout_s: float  # the front end's liveness window: silent this long, each side gives up on the other


@CHANNEL.message("pong")
@dataclass
class Pong:
    seq: int  # the Ping answered
