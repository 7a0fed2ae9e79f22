"""The conductor channel: a front end asks where a request should run.

Request/reply over :mod:`yutu.rpc` (DEALER -> ROUTER)::

    gateway                      conductor
    Place        ------------->  the placement policy (yutu.sched) over the global view
                 <-------------  Placement (prefill instance or none, decode instance, prefix plan,
                                 predicted TTFT and TBT) | Rejected
    Observed     ------------->  what the request really took (TTFT), for /placements/recent
                 <-------------  Ack
    Finished     ------------->  the request ended (any way): it no longer counts on its instances
                 <-------------  Ack

Instances are named by instance id; their endpoints come from the registry. Tokens never pass
through the conductor.
"""

from __future__ import annotations

from dataclasses import dataclass

from yutu.protocol.codec import Channel

CHANNEL = Channel("conductor", version=4)  # 4: Place.priority


@CHANNEL.message("place")
@dataclass
class Place:
    request_id: str
    block_keys: list[str]  # chained keys (hex) of the prompt's full blocks, in order
    prompt_len: int
    max_tokens: int
    exclude: list[str]  # instance ids not to use (a retry after one of them failed)
    waited_s: float = 0.0  # how long the request already waited in the front end (counts in its TTFT)
    priority: int = 0  # served before higher values, after lower ones (yutu.engine.scheduler)


@CHANNEL.message("placement")
@dataclass
class Placement:
    request_id: str
    prefill: str | None  # prefill instance id; None: the decode instance prefills it itself
    decode: str
    local_blocks: int  # leading blocks the chosen prefiller holds in its own prefix cache
    store_blocks: int  # leading blocks to use from the store (>= local_blocks means fetch the rest)
    recompute_tokens: int
    predicted_ttft_s: float
    predicted_tbt_s: float
    policy: str
    reason: str


@CHANNEL.message("rejected")
@dataclass
class Rejected:
    request_id: str
    kind: str  # a yutu.errors.ErrorKind value: "overloaded_error" (429) or "service_unavailable" (503)
    message: str
    retry_after_s: float
    predicted_ttft_s: float
    predicted_tbt_s: float


@CHANNEL.message("observed")
@dataclass
class Observed:
    request_id: str
    ttft_s: float  # measured at the gateway: request received -> first token sent
    prefill: str | None
    decode: str
    cached_tokens: int


@CHANNEL.message("finished")
@dataclass
class Finished:
    """Sent once per placed request when it ends (finished, failed or aborted). Without it, a
    request that ended between two load reports would count on its decode instance until the
    conductor's handoff TTL: O(requests a second x TTL) of pending work in every placement."""

    request_id: str


@CHANNEL.message("ack")
@dataclass
class Ack:
    request_id: str
