"""One request inside the engine: its tokens, how many are computed, and its lifecycle status."""

from __future__ import annotations

import array
import enum

import torch

from yutu.engine.outputs import FinishReason, TokenLogprobs
from yutu.engine.sampling import SamplingParams
from yutu.engine.structured import Grammar
from yutu.kv.hashing import block_key_digests, chain_key


class RequestStatus(enum.Enum):
    """Lifecycle of a sequence::

    WAITING --admit--> RUNNING --finish--> FINISHED_*
       |                  |  ^    \
       | admit, KV        |  |     `-- first token of a prefill-only request --> HELD --release--> freed
       | to import        |  |
       v                  |  |
    LOADING --loaded------'  |  re-admit (recompute prompt + generated tokens)
                  preempt v  |
                       PREEMPTED (back at the front of the waiting queue)

    LOADING: blocks are allocated and KV for some leading tokens is being copied in from outside
    (a peer's cache, the KV store); the sequence is not scheduled until the copy is done. HELD: a
    prefill-only request sampled its first token; its blocks stay allocated until released.
    """

    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    PREEMPTED = "preempted"
    HELD = "held"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASON

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Sequence:
    """A request's token stream. Tokens ``[0, num_computed_tokens)`` have K/V in the cache.

    ``token_ids`` = prompt followed by generated tokens. Whether the sequence needs prefill is derived
    from the counters, never stored: it has more than one token left to compute. A sequence with
    exactly one uncomputed token (its last sampled token, or a one-token prompt) is a decode step.

    ``block_keys`` holds the chained digests of every full block of ``token_ids`` and is kept in step
    with ``append_token``; the block manager reads it, nobody else writes it.
    """

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        root_key: bytes,
        generator: torch.Generator | None = None,
        grammar: Grammar | None = None,
    ) -> None:
        assert prompt_token_ids, "the engine validates prompts before building a sequence"
        self.seq_id = seq_id
        self.params = params
        self.block_size = block_size
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission (+ KV imported)
        self.generator = generator  # per-request RNG when params.seed is set
        self.grammar = grammar  # the matcher of params.grammar, following the output (None: no grammar)
        # Leading tokens whose KV is copied in from outside at admission (0: none). Consumed once
        # the copy is done: a re-admission after preemption recomputes instead.
        self.kv_import_tokens = 0
        self.prefill_only = False  # stop after the first token and hold the blocks (prefill role)
        self.awaiting_token = False  # admitted before its first token: it comes with the imported KV
        self.priority = 0  # served before those of a higher value, after those of a lower (vLLM's)
        self.prefill_compute_s = (
            0.0  # its share (by tokens) of the time of the steps that computed its prompt
        )
        self._root_key = root_key
        self.block_keys: list[bytes] = block_key_digests(root_key, self.token_ids, block_size)
        # ``token_ids`` as machine integers, kept for a request whose logits a bias or a penalty
        # adjusts: the sampler reads them every step, and converting the list each time would cost
        # ~36 ns a token (yutu.engine.sampler.TokenHistory).
        self.token_array = array.array("q", self.token_ids) if params.adjusts_logits else None
        # The prompt's logprobs so far (params.prompt_logprobs), entry i for token i, until they go out
        # with the first token; None when not asked or already sent. While set, the prompt is computed
        # whole: no prefix-cache hit (yutu.engine.scheduler).
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def needs_prefill(self) -> bool:
        """More than one token is left to compute (a prompt, or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_decode(self) -> bool:
        """Exactly one token is left to compute: the next step samples after it."""
        return self.num_uncomputed_tokens == 1

    def append_token(self, token_id: int) -> None:
        """Append a sampled token; extend ``block_keys`` when it completes a block. A sequence with
        a grammar advances it first: a token the grammar refuses raises InvalidRequestError and is
        not appended."""
        if self.grammar is not None:
            self.grammar.advance(token_id)
        self.token_ids.append(token_id)
        if self.token_array is not None:
            self.token_array.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            parent = self.block_keys[-1] if self.block_keys else self._root_key
            self.block_keys.append(chain_key(parent, self.token_ids[-self.block_size :]))

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, prompt={self.num_prompt_tokens})"
        )
