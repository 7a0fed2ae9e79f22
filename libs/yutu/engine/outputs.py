"""Plain data objects the engine hands back to its caller after each step."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(str, enum.Enum):
    """Why a request stopped, spelled as the OpenAI API spells ``finish_reason``."""

    STOP = "stop"  # an eos token (unless ignore_eos) or one of params.stop_token_ids
    LENGTH = "length"  # max_tokens generated or max_model_len reached
    ABORT = "abort"  # aborted by the caller


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of a sampled token under the model's raw distribution, and the top alternatives.

    ``top`` holds ``params.logprobs`` pairs ``(token_id, logprob)`` in descending logprob order (empty
    when ``params.logprobs == 0``); the sampled token may or may not be among them. ``rank``, set for
    a prompt's tokens (vLLM's ``prompt_logprobs`` show it): how many tokens of the vocabulary are at
    least as likely as this one, itself included (1: the most likely; ties count ahead, as vLLM counts).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None

    def to_wire(self) -> list[object]:
        """As the worker channels carry it: [token_id, logprob, [[alt_id, alt_logprob], ...]], then
        the rank where it is known."""
        wire: list[object] = [self.token_id, self.logprob, [list(alt) for alt in self.top]]
        if self.rank is not None:
            wire.append(self.rank)
        return wire


@dataclass(frozen=True)
class HeldKV:
    """The blocks of a held request: ``block_ids`` in token order hold the KV of ``num_tokens`` tokens."""

    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True)
class StepRecord:
    """What one engine step computed, and its wall time (the conductor fits its models on these)."""

    num_decodes: int  # sequences that got one decode token
    decode_kv_tokens: int  # context tokens of those sequences
    num_prefill_tokens: int  # prompt (or recompute) tokens computed
    seconds: float


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: the tokens appended this step (usually one).

    A *failed* output has ``error`` set (a message for the user): the engine gave up on the request
    in this step (see ``LLMEngine.step``). It is aborted and its blocks are freed: ``finished`` is
    True, ``finish_reason`` is ``ABORT``, and it carries no tokens. No further output follows. A
    *refused* one (``refused``) is the request's own fault, found after ``add_request`` returned:
    its grammar did not compile, the tokens generated elsewhere do not follow it, or it gave up
    (a limit of the grammar engine's).

    A prefill-only request's first token comes with ``kv_held`` set and ``finished`` True but no
    ``finish_reason``: the engine is done with it, its blocks are held until ``LLMEngine.release``.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None  # one per new token when params.logprobs is not None
    finished: bool
    finish_reason: FinishReason | None  # set iff finished
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache at first admission
    error: str | None = None  # set iff the engine failed the request (then finished, no tokens)
    refused: bool = False  # with error: the request's own fault (its grammar, say), not the engine's
    kv_held: HeldKV | None = None  # a prefill-only request's blocks, held for a peer to read
    prefill_s: float | None = None  # with the first token: the prompt's share (by tokens) of its steps' time
    # With the first token, when params.prompt_logprobs is set: one entry per prompt token, each
    # under the tokens before it; the first token's None (nothing comes before it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and counters (counters are totals since start)."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_blocks: int
    kv_usage: float  # fraction of KV blocks held by running sequences, in [0, 1]
    prefix_cache_queries_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_loading: int  # admitted requests waiting for imported KV
    num_held: int  # prefill-only requests whose blocks are held for a peer
    failed_steps_total: int  # steps that raised (their requests were failed)
    failed_requests_total: int  # requests the engine failed: in a failed step, or non-finite logits
    num_prefilling: int  # waiting, or running with prompt tokens still to compute
