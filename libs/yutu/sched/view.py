"""Snapshot types: what a placement policy sees of the cluster and of one request.

The conductor (or a simulator) builds a :class:`ClusterView` for each placement from the load reports
and KV events it holds, and passes it with the :class:`RequestView` and the current time to
``Policy.place``. Every type here is plain, frozen data: policies read it and never mutate it.

Times are absolute seconds on the caller's clock (the one ``now`` is read from); durations are seconds.
Token and block counts are ints. Block keys are the chained hex keys of ``yutu.kv.hashing``: key ``i``
covers blocks ``0..i``, so a cache holding key ``i`` holds the KV of everything up to block ``i``.

Key sets (``cached``, ``store``) are any ``Container[str]``: a ``frozenset``, a ``set`` or an index
object answering ``key in index``. The caller must not change one during a ``place`` call; handing
over a live set the caller mutates only between calls avoids copying a large index per request.

Running and queued state is as of ``now``: ``remaining_tokens`` counts the tokens a running sequence
may still generate from this instant (``max_tokens`` minus what it generated: an upper bound, since a
sequence may stop early), so load forecasts are conservative.
"""

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import dataclass, field

KeySet = Container[str]


def _check_count(name: str, value: int, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_priority(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_seconds(name: str, value: float, *, positive: bool = False) -> None:
    bad = not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
    if bad or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True)
class RequestView:
    """The request to place: its id, the keys of its full prompt blocks, and its lengths.

    ``block_keys`` holds the keys of the prompt's full blocks, in order (a partial tail block has
    none); ``ClusterView.check_request`` verifies there are at most ``prompt_len // block_size``.
    ``waited_s`` is how long the request already waited before it asked to be placed (in a busy
    front end): its client counts it in the TTFT, so the TTFT SLO does too. ``priority``: the
    engines serve a lower value first (vLLM's; 0 by default), so only the queued prompts that run
    before it count in its wait (:meth:`QueuedPrefill.runs_before`).
    """

    request_id: str
    block_keys: tuple[str, ...]
    prompt_len: int
    max_tokens: int
    waited_s: float = 0.0
    priority: int = 0

    def __post_init__(self) -> None:
        _check_count("RequestView.prompt_len", self.prompt_len, 1)
        _check_count("RequestView.max_tokens", self.max_tokens, 1)
        if not (
            isinstance(self.waited_s, int | float) and math.isfinite(self.waited_s) and self.waited_s >= 0
        ):
            raise ValueError(
                f"RequestView.waited_s must be a finite number of seconds >= 0, got {self.waited_s!r}"
            )
        if not isinstance(self.block_keys, tuple):
            raise ValueError("RequestView.block_keys must be a tuple of hex keys (pass tuple(keys))")
        _check_priority("RequestView.priority", self.priority)


@dataclass(frozen=True)
class QueuedPrefill:
    """One prompt queued or running on a prefill instance.

    Its remaining work is tokens ``[reused_tokens + computed_tokens, prompt_len)``: ``reused_tokens``
    came from a cache (local or store) and ``computed_tokens`` were already computed by chunked prefill
    (0 for a prompt still waiting). ``priority`` is its request's; ``admitted``: the engine took it
    on (its blocks are allocated, its chunks run), so it ends before any waiting prompt starts,
    whatever their priorities.
    """

    prompt_len: int
    reused_tokens: int = 0
    computed_tokens: int = 0
    priority: int = 0
    admitted: bool = False

    def __post_init__(self) -> None:
        _check_count("QueuedPrefill.prompt_len", self.prompt_len, 1)
        _check_count("QueuedPrefill.reused_tokens", self.reused_tokens)
        _check_count("QueuedPrefill.computed_tokens", self.computed_tokens)
        _check_priority("QueuedPrefill.priority", self.priority)
        if self.reused_tokens + self.computed_tokens > self.prompt_len:
            raise ValueError(
                f"QueuedPrefill: reused ({self.reused_tokens}) + computed ({self.computed_tokens}) tokens "
                f"exceed prompt_len ({self.prompt_len})"
            )

    @property
    def done_tokens(self) -> int:
        """Tokens whose KV exists already: reused plus computed."""
        return self.reused_tokens + self.computed_tokens

    def runs_before(self, priority: int) -> bool:
        """Whether this prompt's prefill runs before that of a request of ``priority`` queued after
        it: admitted, or waiting with a priority no higher (equals are served first come first)."""
        return self.admitted or self.priority <= priority


@dataclass(frozen=True)
class PrefillView:
    """A live prefill instance.

    ``free_blocks``: KV blocks it can still allocate for new prompts, after what its queue needs (the
    conductor subtracts the blocks of requests it placed there that the instance has not reported).
    ``bandwidth_bps``: measured store-to-instance bandwidth in bytes/s, or None to use the shared
    transfer model's estimate.
    """

    instance_id: str
    cached: KeySet
    free_blocks: int
    queue: tuple[QueuedPrefill, ...] = ()
    bandwidth_bps: float | None = None

    def __post_init__(self) -> None:
        _check_count(f"PrefillView({self.instance_id}).free_blocks", self.free_blocks)
        if self.bandwidth_bps is not None:
            _check_seconds(
                f"PrefillView({self.instance_id}).bandwidth_bps", self.bandwidth_bps, positive=True
            )


@dataclass(frozen=True)
class RunningDecode:
    """A sequence in a decode instance's running batch: its KV tokens now, tokens it may still emit."""

    kv_tokens: int
    remaining_tokens: int

    def __post_init__(self) -> None:
        _check_count("RunningDecode.kv_tokens", self.kv_tokens, 1)
        _check_count("RunningDecode.remaining_tokens", self.remaining_tokens)


@dataclass(frozen=True)
class IncomingDecode:
    """A request placed on a decode instance whose prefill has not ended yet.

    It joins the batch at ``arrival_s`` (absolute, the ``ready_at_s`` of its placement) with
    ``prompt_len`` KV tokens and may then emit up to ``max_tokens - 1`` more tokens (prefill emits
    the first).
    """

    arrival_s: float
    prompt_len: int
    max_tokens: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s):
            raise ValueError(f"IncomingDecode.arrival_s must be finite, got {self.arrival_s!r}")
        _check_count("IncomingDecode.prompt_len", self.prompt_len, 1)
        _check_count("IncomingDecode.max_tokens", self.max_tokens, 1)


@dataclass(frozen=True)
class DecodeView:
    """A live decode instance.

    ``free_blocks``: KV blocks free now as the instance reports them; the policies add back what
    running sequences free by the time a request joins and subtract what ``incoming`` requests take.
    ``max_batch``: the most sequences it runs in one step.
    ``cached``: its local prefix cache (used when it prefills a short uncached remainder itself).
    ``chunk_tokens``: prompt tokens one of its steps computes when it prefills (chunked prefill, the
    engine's ``max_num_batched_tokens``); None: a prefill it runs rides one step whole.
    ``prefills``: prompts it prefills itself (placed on it without a prefill instance), queued or
    running, until their first token; each is also in ``incoming``, which forecasts its decode.
    """

    instance_id: str
    free_blocks: int
    max_batch: int
    running: tuple[RunningDecode, ...] = ()
    incoming: tuple[IncomingDecode, ...] = ()
    cached: KeySet = field(default_factory=frozenset)
    bandwidth_bps: float | None = None
    chunk_tokens: int | None = None
    prefills: tuple[QueuedPrefill, ...] = ()

    def __post_init__(self) -> None:
        _check_count(f"DecodeView({self.instance_id}).free_blocks", self.free_blocks)
        _check_count(f"DecodeView({self.instance_id}).max_batch", self.max_batch, 1)
        if self.chunk_tokens is not None:
            _check_count(f"DecodeView({self.instance_id}).chunk_tokens", self.chunk_tokens, 1)
        if self.bandwidth_bps is not None:
            _check_seconds(f"DecodeView({self.instance_id}).bandwidth_bps", self.bandwidth_bps, positive=True)

    @property
    def batch_size(self) -> int:
        """Sequences running now."""
        return len(self.running)

    @property
    def kv_tokens(self) -> int:
        """KV tokens of the running sequences now."""
        return sum(r.kv_tokens for r in self.running)


@dataclass(frozen=True)
class ClusterView:
    """Everything a policy sees: live instances, the store's keys and the KV geometry.

    ``bytes_per_block``: size of one store object (one block of every layer), for transfer times.
    Instance ids must be unique within ``prefills`` and within ``decodes``.
    """

    prefills: tuple[PrefillView, ...]
    decodes: tuple[DecodeView, ...]
    store: KeySet
    bytes_per_block: int
    block_size: int = 16

    def __post_init__(self) -> None:
        _check_count("ClusterView.block_size", self.block_size, 1)
        _check_count("ClusterView.bytes_per_block", self.bytes_per_block, 1)
        for kind, ids in (
            ("prefill", [p.instance_id for p in self.prefills]),
            ("decode", [d.instance_id for d in self.decodes]),
        ):
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            if dupes:
                raise ValueError(f"ClusterView: duplicate {kind} instance ids {dupes}; each must be unique")

    def check_request(self, request: RequestView) -> None:
        """Raise ValueError when ``request`` has more block keys than full blocks of its prompt."""
        full = request.prompt_len // self.block_size
        if len(request.block_keys) > full:
            raise ValueError(
                f"request {request.request_id}: {len(request.block_keys)} block keys for a prompt of "
                f"{request.prompt_len} tokens ({full} full blocks of {self.block_size}); "
                "hash with the cluster's block size"
            )
