"""The prefill channel: a front end asks a prefill instance for a request's first token.

Request/reply over :mod:`yutu.rpc` (DEALER -> ROUTER)::

    gateway                          prefill instance
    PrefillRequest  ------------->   local prefix, then store blocks fetched into its KV cache,
                                     then chunked prefill of the rest; samples the first token
                    <-------------   PrefillResult (first token + KV handle; blocks held under a lease)
    decode instance
    ReleaseKV       ------------->   the decode pulled the blocks (or gave up): the hold is freed
                    <-------------   Released
    RenewKV         ------------->   the decode needs the blocks longer: the lease restarts
                    <-------------   Released (held=False if the hold was already gone)
    gateway
    Ping            ------------->   a heartbeat (an instance that stops answering gets no requests,
                    <-------------   Pong              and the calls in flight to it fail)

A :class:`KVHandle` names the blocks: segment + region of the prefill's KV cache, and the block ids
in token order; block ``b`` is ``[b * block_bytes, (b + 1) * block_bytes)`` of that region. It also
names the hold (``hold_id``, the prefill's request id): whoever pulls the blocks releases that, under
whatever id it runs the request itself (a decode told of a re-placed prefill runs it as ``<id>-p1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from yutu.protocol.codec import Channel
from yutu.protocol.wire import fields_of, float_field, int_field, int_list, str_field

CHANNEL = Channel("prefill", version=5)  # 2: KV handles carry kv_salt; 3: and the id of their hold;
# 4: PrefillRequest.cache_salt; 5: and its priority


@dataclass(frozen=True)
class KVHandle:
    """Where a held request's KV lies, and who to tell when it has been pulled."""

    instance_id: str  # the prefill instance holding the blocks
    hold_id: str  # the request id it holds them under: what ReleaseKV / RenewKV name
    control: str  # its prefill-channel endpoint (ReleaseKV / RenewKV go there)
    segment: str  # its transfer-engine segment
    region: str  # the KV cache region in that segment
    block_ids: list[int]  # in token order; covers [0, num_tokens)
    num_tokens: int  # tokens whose KV the blocks hold
    block_bytes: int
    lease_s: float  # the hold lasts this long unless renewed
    kv_salt: str  # what the prefill's engine salts block keys with: its model and dtype

    _FIELDS = (
        "instance_id",
        "hold_id",
        "control",
        "segment",
        "region",
        "block_ids",
        "num_tokens",
        "block_bytes",
        "lease_s",
        "kv_salt",
    )

    def to_wire(self) -> list[Any]:
        return [getattr(self, name) for name in self._FIELDS]

    @classmethod
    def from_wire(cls, raw: Any) -> KVHandle:
        f = fields_of(raw, cls._FIELDS, "KV handle")
        return cls(
            instance_id=str_field(f["instance_id"], "kv.instance_id"),
            hold_id=str_field(f["hold_id"], "kv.hold_id"),
            control=str_field(f["control"], "kv.control"),
            segment=str_field(f["segment"], "kv.segment"),
            region=str_field(f["region"], "kv.region"),
            block_ids=int_list(f["block_ids"], "kv.block_ids"),
            num_tokens=int_field(f["num_tokens"], "kv.num_tokens", 1),
            block_bytes=int_field(f["block_bytes"], "kv.block_bytes", 1),
            lease_s=float_field(f["lease_s"], "kv.lease_s"),
            kv_salt=str_field(f["kv_salt"], "kv.kv_salt"),
        )


@CHANNEL.message("prefill")
@dataclass
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields (yutu.engine.sampling)
    store_blocks: int  # leading blocks the conductor saw in the store (fetched past the local prefix)
    arrival_time: float  # wall clock (time.time()) at the gateway
    cache_salt: str | None = None  # its blocks' keys are salted apart (yutu.kv.hashing.salted_root)
    priority: int = 0  # served before higher values, after lower ones (yutu.engine.scheduler)


@CHANNEL.message("prefilled")
@dataclass
class PrefillResult:
    request_id: str
    token_id: int  # the first generated token
    logprobs: list[Any] | None  # [token_id, logprob, [[alt_id, alt_logprob], ...]] when asked
    finish_reason: str | None  # set when the first token already ends the request (no hold then)
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV was reused (local prefix cache + store)
    kv: list[Any] | None  # KVHandle.to_wire(), None when finish_reason is set


@CHANNEL.message("release")
@dataclass
class ReleaseKV:
    request_id: str


@CHANNEL.message("renew")
@dataclass
class RenewKV:
    request_id: str


@CHANNEL.message("released")
@dataclass
class Released:
    request_id: str
    held: bool  # whether a hold existed (False: it had expired or was never there)


@CHANNEL.message("ping")
@dataclass
class Ping:
    seq: int


@CHANNEL.message("pong")
@dataclass
class Pong:
    seq: int
    in_flight: int  # prefills running or queued there
    held: int  # requests whose blocks wait for their decode
