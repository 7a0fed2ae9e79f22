"""The generate channel: a front end (gateway, later the conductor) and an engine worker.

Flow over one DEALER (front end) -> ROUTER (worker) connection::

    front end                         worker
    GenerateRequest  ------------->   admitted to the engine
                     <-------------   TokenDelta*  (new tokens, as they are sampled)
                     <-------------   TokenDelta   (finish_reason set: the last one)
    AbortRequest     ------------->   request dropped, its KV blocks freed
                     <-------------   RequestFailed (instead of deltas, when it cannot run)

Every worker -> front end message carries the request id; the front end routes by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from yutu.protocol.codec import Channel

CHANNEL = Channel("generate", version=1)


@CHANNEL.message("generate")
@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields (yutu.engine.sampling)
    arrival_time: float  # wall clock (time.time()) at the gateway


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


@CHANNEL.message("failed")
@dataclass
class RequestFailed:
    request_id: str
    kind: str  # a yutu.errors.ErrorKind value
    message: str
