"""LLMEngine: the model engine's public face. One ``step()`` = schedule, run, sample, postprocess.

Thread-safety: LLMEngine is NOT thread-safe. A worker owns it from a single engine thread and calls
``add_request`` / ``abort_request`` / ``step`` there only (hand requests over with a queue).

Length contract (vLLM's): a request is accepted only if ``len(prompt) + max_tokens <= max_model_len``;
otherwise ``add_request`` raises PromptTooLongError, and the caller lowers ``max_tokens``.

Disaggregation (the prefill and decode roles build on three additions to ``add_request``):

- ``prefill_only``: the request stops after its first token and keeps its blocks (``HELD``); the
  output carries them (``RequestOutput.kv_held``) so a peer can read their KV; ``release`` frees them.
- ``import_tokens``: the KV of the first ``import_tokens`` tokens comes from outside (a peer's cache,
  the KV store). At admission the engine takes blocks for the whole sequence, reuses its own prefix
  cache, and lists the blocks still to fill as a :class:`~yutu.engine.scheduler.KVLoad`
  (``take_loads``, or ``on_loads`` as soon as the step that admitted it is scheduled, before its
  forward pass, so the copy overlaps that pass); the caller copies the KV in and calls
  ``finish_load`` with how many tokens arrived. The request is not scheduled in between. Fewer
  tokens than asked are fine: the rest is computed.
- ``generated``: tokens already sampled (the prefill's first token; those streamed before a decode
  instance died), appended as output before the request runs; only new tokens are output.
- ``await_token``: a request admitted while its prompt is still being prefilled elsewhere (a
  decode instance the gateway told early): it imports its whole prompt's KV and its first token
  comes with ``finish_load(..., token=)``, so its blocks are in place when the prefill ends and
  the copy starts at once, without a round trip through this engine first.

Grammars (``SamplingParams.grammar``, yutu.engine.structured): a request whose grammar the engine has
not compiled yet waits outside the scheduler while a thread compiles it (a large JSON schema takes
tens to hundreds of milliseconds, which on the step's thread would stall every running request);
``step()`` admits it once compiled, or returns it failed (``RequestOutput.refused``) if its grammar
does not compile or its ``generated`` tokens do not follow it. A cached grammar is admitted at once.
A grammar that gives up mid-output (one of llguidance's limits: ``GrammarFailed``) is refused too.

Prompt logprobs (``SamplingParams.prompt_logprobs``, the OpenAI API's ``echo`` with ``logprobs``):
every row of such a request's prompt chunks is kept (``ModelRunner.run``'s ``hidden_of``), its
logits computed a few hundred rows at a time, and the logprob of each prompt token under the tokens
before it goes out with the first generated token (``RequestOutput.prompt_logprobs``). Its prompt is
computed whole: no prefix-cache hit, no imported KV, no ``generated``, not prefill-only.

Failure contract: one request never takes the engine down. ``step()`` contains whatever raises inside
it (scheduler, model, sampler, postprocessing): the requests of that step are aborted, their blocks
freed, and each gets a *failed* output (``RequestOutput.error``); the engine then serves the others
and new requests. A request whose logits row is not finite fails alone. ``consecutive_failed_steps``
lets the caller decide when the engine is broken; ``step()`` raises :class:`EngineBrokenError` only
when it cannot go on (the block pool is inconsistent after aborting a failed step's requests).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import torch

from yutu.config import KERNEL_CHOICES
from yutu.engine.cpus import WideStepThreads
from yutu.engine.errors import EngineBrokenError, InvalidRequestError, PromptTooLongError
from yutu.engine.kv_mirror import KVMirror
from yutu.engine.loader import auto_dtype, default_device_and_dtype, load_model, native_bf16
from yutu.engine.model import fuse_projections, pack_cpu_linears
from yutu.engine.model_config import ModelConfig
from yutu.engine.model_runner import KVCacheFactory, ModelRunner, kv_block_bytes
from yutu.engine.native import engine_kernels
from yutu.engine.outputs import EngineStats, FinishReason, HeldKV, RequestOutput, StepRecord, TokenLogprobs
from yutu.engine.sampler import Sampler, TokenHistory, banned_by_bad_words, token_logprobs
from yutu.engine.sampling import SamplingParams
from yutu.engine.scheduler import KVLoad, ScheduledBatch, ScheduledChunk, Scheduler
from yutu.engine.sequence import RequestStatus, Sequence
from yutu.engine.structured import GrammarFailed, Grammars
from yutu.kv.block_manager import BlockManager, CacheEvent
from yutu.kv.hashing import root_key, salted_root

__all__ = [
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "KVLoad",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprobs",
]

log = logging.getLogger(__name__)

# A step is *wide* -- it runs on up to EngineConfig.prefill_threads threads, those no other engine
# computes on (yutu.engine.cpus) -- when it computes WIDE_STEP_TOKENS tokens or more (in practice a
# prompt chunk: a step decodes at most max_num_seqs tokens), or prompt chunks whose attention spans
# WIDE_STEP_SPAN (chunk tokens x context, summed) or more: a short chunk after a long cached prefix.
# Measured on a 2-core CPU, the demo model, two threads against one: fresh prompts 1.2-1.75x from
# 256 to 1,024 tokens, 1.03-1.3x at 128 and ~1.1x at 32-64 tokens; after a cached prefix (three
# interleaved runs), 64 tokens over 960 1.45-1.54x, 128 over 896 1.23-1.60x, 192 over 832
# 1.24-1.68x, 32 over 992 1.3x (a 7 ms step).
WIDE_STEP_TOKENS = 256
WIDE_STEP_SPAN = 48 * 1024
# With nothing to step but requests whose grammars are compiling, step() waits this long for one to be
# done (rather than return at once to a caller that would call it again and spin on a CPU the compile
# needs); a caller's next command waits at most as long.
GRAMMAR_WAIT_S = 0.002
# Prompt logprobs: the rows of a chunk whose logits are computed at a time (a 128k vocabulary's 256
# rows are 128 MiB of float32).
PROMPT_LOGPROBS_ROWS = 256


@dataclass(frozen=True)
class _Compiling:
    """A request waiting for its grammar: admitted (``LLMEngine._admit``) once ``future`` is done."""

    seq: Sequence
    generated: list[int]
    future: Future[llguidance.LLMatcher]


def is_wide(batch: ScheduledBatch) -> bool:
    """Whether ``batch`` is worth more threads (see WIDE_STEP_TOKENS)."""
    if batch.num_tokens >= WIDE_STEP_TOKENS:
        return True
    span = sum(c.num_tokens * c.context_len for c in batch.chunks if c.num_tokens > 1)
    return span >= WIDE_STEP_SPAN


NONFINITE_LOGITS = (
    "the model produced non-finite logits (NaN or inf) for this request; it was aborted. This is an"
    " engine or model failure, not a problem with the request: retry it, and report it if it persists"
)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs, validated on construction (bad values raise ValueError)."""

    model_dir: Path  # Hugging Face checkpoint directory (config.json + *.safetensors)
    model_id: str = ""  # block-hash salt; "" -> the model dir's name. Processes sharing KV must agree.
    block_size: int = 16  # tokens per KV block (paging, hashing and store objects)
    num_kv_blocks: int | None = None  # None -> kv_cache_memory_bytes // bytes per block
    kv_cache_memory_bytes: int = 256 * 2**20  # KV pool size when num_kv_blocks is None
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 512  # tokens per forward pass (chunked-prefill budget)
    # Tokens of a forward pass that decodes nothing (only prompts' chunks), when more than
    # max_num_batched_tokens: no decode's pace to keep, so fewer, longer chunks. None: the same.
    max_prefill_step_tokens: int | None = None
    max_model_len: int | None = None  # prompt + output tokens; None -> min(model max, KV pool)
    enable_prefix_caching: bool = True
    device: torch.device | str | None = None  # None -> CUDA if available, else CPU
    dtype: torch.dtype | str | None = None  # None or "auto" -> yutu.engine.loader.auto_dtype
    # Builds the KV cache tensor (a view over registered memory, so peers can read its blocks);
    # None: plain device memory. See ModelRunner.
    kv_cache_factory: KVCacheFactory | None = None
    # The factory's tensor as the host mirror of a cache in device memory (yutu.engine.kv_mirror)
    # rather than the cache itself. None: when the device is not the CPU (a GPU computes in its own
    # memory; peers and the store move host memory).
    kv_mirror: bool | None = None
    # The dense decode cache (yutu.engine.decode_cache): decodes attend over contiguous copies
    # instead of gathering their blocks every step. None -> on CPU a quarter of the KV pool (at
    # most 1 GiB), elsewhere off; 0 -> off (every decode on the paged path).
    dense_decode_bytes: int | None = None
    # The CPU kernels (yutu.engine.native: the dense decode cache's attention; each layer's norms,
    # rotary and SwiGLU): "native" (C++, built once per machine; an error where it cannot be),
    # "torch" (torch's operations, the reference) or "auto" (native on CPU where they build, else
    # torch's, with a warning).
    kernels: str = "auto"
    # The most torch threads a wide step (a long prompt's chunk; see WIDE_STEP_TOKENS) takes on CPU:
    # those no other engine of the host computes on when it starts (yutu.engine.cpus), never fewer
    # than the process's threads, which every other step runs on. None: the process's threads always.
    prefill_threads: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if not self.model_id:
            object.__setattr__(self, "model_id", self.model_dir.name)
        for name in ("block_size", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dense_decode_bytes is not None and (
            not isinstance(self.dense_decode_bytes, int) or self.dense_decode_bytes < 0
        ):
            raise ValueError(
                f"dense_decode_bytes must be an integer >= 0 or None, got {self.dense_decode_bytes!r}"
            )
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        for name in ("num_kv_blocks", "max_model_len", "prefill_threads", "max_prefill_step_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None (derived), got {value!r}")


@contextlib.contextmanager
def wide_step_threads(n: int, native: Any) -> Iterator[None]:
    """Run a wide step on ``n`` torch threads, each bound to its own CPU for the step when the
    native kernels are there (``spread_threads``, csrc/threads.cpp: two threads that start on one
    CPU otherwise stay there)."""
    with torch_threads(n):
        if n < 2 or native is None or not native.spread_threads(True):
            yield
            return
        try:
            yield
        finally:
            native.spread_threads(False)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on ``n`` torch (intra-op) threads, then go back to the process's count."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def kv_salt(model_id: str, dtype: torch.dtype, longrope_regime: str | None = None) -> str:
    """What block keys are salted with: the model id, plus the dtype unless float32 (KV blocks of
    one model in two dtypes differ in bytes, so they must never share keys), plus ``+longrope-long``
    for a LongRoPE model rotated by its long factors (``ModelConfig.for_context``: other keys)."""
    salt = model_id if dtype == torch.float32 else f"{model_id}@{str(dtype).removeprefix('torch.')}"
    return f"{salt}+longrope-long" if longrope_regime == "long" else salt


def _resolve_dtype(dtype: torch.dtype | str | None, default: torch.dtype) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default
    resolved = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), None)
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype!r} is not one of auto, float32, bfloat16, float16")
    return resolved


DENSE_DECODE_MAX_BYTES = 1 << 30


class LLMEngine:
    """Continuous-batching engine over a paged, prefix-cached KV pool. See the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.device is None:
            self.device, default_dtype = default_device_and_dtype()
        else:
            self.device = torch.device(config.device)
            default_dtype = auto_dtype(self.device)
        self.dtype = _resolve_dtype(config.dtype, default_dtype)
        self.model_id = config.model_id
        model, self.model_config = load_model(config.model_dir, self.device, self.dtype, config.max_model_len)
        self.kv_salt = kv_salt(config.model_id, self.dtype, self.model_config.longrope_regime)
        fuse_projections(model)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and native_bf16():
            pack_cpu_linears(model)  # elsewhere oneDNN would emulate bfloat16: the plain path stays
        self.num_kv_blocks = config.num_kv_blocks or (
            config.kv_cache_memory_bytes // kv_block_bytes(self.model_config, config.block_size, self.dtype)
        )
        self.max_model_len = self._resolve_max_model_len(self.model_config, self.num_kv_blocks)
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_prefill_step_tokens,
        )
        mirrored = self._mirrored(config)
        dense_bytes = self._dense_decode_bytes(config)
        native = engine_kernels(config.kernels, self.device)
        self.kernels = "native" if native is not None else "torch"  # what the steps run on
        self._native = native
        model.ops = native  # each layer's elementwise steps (None: torch's operations)
        self.runner = ModelRunner(
            model,
            self.model_config,
            self.num_kv_blocks,
            config.block_size,
            self.device,
            self.dtype,
            None if mirrored else config.kv_cache_factory,
            dense_decode_bytes=dense_bytes,
            max_model_len=self.max_model_len,
            kernels=native,
        )
        self.mirror: KVMirror | None = None  # the host copy peers and the store read (None: no copy)
        if mirrored:
            assert config.kv_cache_factory is not None
            shape = self.model_config.kv_cache_shape(self.num_kv_blocks, config.block_size)
            self.mirror = KVMirror(self.runner.kv_cache, config.kv_cache_factory(shape, self.dtype))
        self._load_blocks: dict[str, list[int]] = {}  # a loading request's imported blocks (mirror only)
        self.sampler = Sampler(native)
        self.grammars = Grammars(
            config.model_dir, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        # Picks a wide step's threads (None: every step on the process's threads).
        self.wide_step_threads = (
            WideStepThreads(config.prefill_threads)
            if config.prefill_threads is not None and self.device.type == "cpu"
            else None
        )
        self.last_wide_threads: int | None = None  # threads the last wide step ran on
        self._root_key = root_key(self.kv_salt)
        self._seqs: dict[str, Sequence] = {}  # unfinished requests by id (loading ones included)
        self._held: dict[str, Sequence] = {}  # prefill-only requests done, blocks kept until release
        self._compiling: dict[str, _Compiling] = {}  # requests waiting for their grammar, in order
        self._loads: list[KVLoad] = []  # admitted imports not yet taken by the caller
        # Given a step's admitted imports once it is scheduled, before its forward pass (instead of
        # leaving them to take_loads after it): a caller that fills them on another thread or process
        # copies while the step computes, and the request can join the next step rather than the one
        # after (on a decode instance busy with a long prompt chunk, a whole step sooner).
        self.on_loads: Callable[[list[KVLoad]], None] | None = None
        self.last_step: StepRecord | None = None  # what the last step that ran did, and how long it took
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._failed_steps_total = 0
        self._failed_requests_total = 0
        self.consecutive_failed_steps = 0  # steps in a row that raised, or where every sampled request failed
        self.last_failure: str | None = None  # what the last failed step or request died of

    def _mirrored(self, config: EngineConfig) -> bool:
        mirrored = config.kv_mirror if config.kv_mirror is not None else self.device.type != "cpu"
        if mirrored and config.kv_cache_factory is None:
            if config.kv_mirror:
                raise ValueError("kv_mirror needs a kv_cache_factory: the host memory to mirror the cache in")
            return False  # a cache nobody else reads: nothing to mirror
        return mirrored

    def _dense_decode_bytes(self, config: EngineConfig) -> int:
        if config.dense_decode_bytes is not None:
            return config.dense_decode_bytes
        if self.device.type != "cpu":
            return 0  # gathers are cheap next to a GPU's bandwidth; not measured there yet
        pool = self.num_kv_blocks * kv_block_bytes(self.model_config, config.block_size, self.dtype)
        return min(pool // 4, DENSE_DECODE_MAX_BYTES)

    def _resolve_max_model_len(self, mc: ModelConfig, num_blocks: int) -> int:
        capacity = num_blocks * self.config.block_size
        requested = self.config.max_model_len
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={self.config.kv_cache_memory_bytes} holds no KV block of this model; "
                "raise it or set num_kv_blocks"
            )
        served = mc.positions_served
        if served < mc.max_position_embeddings:
            log.info(
                "%s's LongRoPE is served by its short factors up to its pretraining length, %d of its %d "
                "positions; a longer max_model_len rotates every sequence by its long factors",
                mc.architecture,
                served,
                mc.max_position_embeddings,
            )
        elif mc.longrope_regime == "long":
            log.info(
                "%s's LongRoPE: every sequence rotated by its long factors (max_model_len past the "
                "pretraining length, %d)",
                mc.architecture,
                (mc.rope_scaling or {})["original_max_position_embeddings"],
            )
        if requested is None:
            if capacity < served:
                log.warning(
                    "KV pool holds %d tokens < the model's %d positions: max_model_len set to %d",
                    capacity,
                    served,
                    capacity,
                )
            return min(served, capacity)
        if requested > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={requested} exceeds the model's max_position_embeddings="
                f"{mc.max_position_embeddings}; lower max_model_len"
            )
        if requested > capacity:
            raise ValueError(
                f"max_model_len={requested} does not fit the KV pool of {num_blocks} blocks x "
                f"{self.config.block_size} tokens = {capacity}; raise num_kv_blocks / kv_cache_memory_bytes "
                "or lower max_model_len"
            )
        return requested

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        generated: Seq[int] = (),
        import_tokens: int = 0,
        prefill_only: bool = False,
        await_token: bool = False,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. Raises InvalidRequestError / PromptTooLongError (ValueErrors) on bad input;
        a grammar new to the engine is compiled meanwhile, and what is wrong with it (or with the
        ``generated`` tokens under it) comes from ``step()`` as a refused output instead.

        ``generated``, ``import_tokens``, ``prefill_only`` and ``await_token``: see the module
        docstring (``await_token`` takes ``import_tokens`` = the prompt's length, nothing generated).
        ``cache_salt``: the request's blocks are keyed apart (:func:`yutu.kv.hashing.salted_root`):
        it shares cached KV only with requests of the same salt. ``priority``: served before the
        requests of a higher value, after those of a lower (vLLM's; see :mod:`yutu.engine.scheduler`).
        """
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._seqs or request_id in self._held or request_id in self._compiling:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight; use a unique id")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        try:
            root = salted_root(self._root_key, cache_salt)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**63) <= priority < 2**63:
            raise InvalidRequestError(f"priority must be an integer (int64), got {priority!r}")
        self._check_token_ids(prompt_token_ids, "prompt")
        generated = list(generated)
        self._check_token_ids(generated, "generated")
        if params.logit_bias:
            self._check_token_ids([token for token, _ in params.logit_bias], "logit_bias")
        if params.allowed_token_ids is not None:
            self._check_token_ids(list(params.allowed_token_ids), "allowed_token_ids")
        if params.bad_words:
            self._check_token_ids([token for word in params.bad_words for token in word], "bad_words")
        if params.grammar_after_thinking is not None:
            self._check_token_ids(list(params.grammar_after_thinking[:2]), "grammar_after_thinking")
        if len(generated) >= params.max_tokens:
            raise InvalidRequestError(
                f"{len(generated)} tokens are already generated of max_tokens={params.max_tokens}: nothing left to do"
            )
        if prefill_only and generated:
            raise InvalidRequestError("a prefill-only request cannot carry generated tokens")
        if params.prompt_logprobs is not None and (generated or prefill_only or import_tokens or await_token):
            raise InvalidRequestError(
                "a request asking for prompt logprobs is computed whole here: it carries no generated tokens"
                " (its prompt logprobs went out with its first token), imports no KV and is not prefill-only"
            )
        num_tokens = len(prompt_token_ids) + len(generated)
        if await_token:
            if generated or prefill_only or import_tokens != len(prompt_token_ids) or params.max_tokens < 2:
                raise InvalidRequestError(
                    "a request awaiting its first token imports its whole prompt's KV (import_tokens ="
                    f" {len(prompt_token_ids)}, got {import_tokens!r}), has nothing generated, is not"
                    f" prefill-only and has tokens left after the first (max_tokens >= 2, got {params.max_tokens})"
                )
            num_tokens += 1  # the awaited token is the one computed
        if type(import_tokens) is not int or not 0 <= import_tokens < num_tokens:
            raise InvalidRequestError(
                f"import_tokens must be an integer in [0, {num_tokens - 1}] (one token is always computed),"
                f" got {import_tokens!r}"
            )
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {total} were "
                f"requested ({len(prompt_token_ids)} in the prompt, {params.max_tokens} in max_tokens); "
                "shorten the prompt or lower max_tokens"
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        seq = Sequence(
            request_id,
            prompt_token_ids,
            params,
            self.config.block_size,
            root,
            generator=generator,
        )
        seq.kv_import_tokens = import_tokens
        seq.prefill_only = prefill_only
        seq.awaiting_token = await_token
        seq.priority = priority
        if params.grammar is not None and not self.grammars.is_compiled(params.grammar):
            self._compiling[request_id] = _Compiling(seq, generated, self.grammars.compile(params.grammar))
            return
        self._admit(seq, generated)

    def _admit(
        self, seq: Sequence, generated: list[int], compiled: llguidance.LLMatcher | None = None
    ) -> None:
        """Give ``seq`` its grammar's matcher (``compiled``: its compile's result), replay the tokens
        ``generated`` elsewhere, and queue it. Raises InvalidRequestError if its grammar does not
        compile or the tokens do not follow it."""
        params = seq.params
        if params.grammar is not None:
            seq.grammar = self.grammars.matcher(params.grammar, compiled, params.grammar_after_thinking)
        for token in generated:  # with a grammar, each must follow it (else InvalidRequestError)
            seq.append_token(token)
        if seq.generator is not None and not params.is_greedy:
            Sampler.skip_draws(seq.generator, len(generated))
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        self._prompt_tokens_total += seq.num_prompt_tokens

    def _admit_compiled(self) -> list[RequestOutput]:
        """Admit the requests whose grammars have compiled (waiting up to GRAMMAR_WAIT_S for one when
        nothing else is to be stepped); a refused output for each whose grammar failed."""
        if not self.scheduler.has_unfinished():
            wait_for([c.future for c in self._compiling.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        refused = []
        for request_id, waiting in list(self._compiling.items()):
            if not waiting.future.done():
                continue
            del self._compiling[request_id]
            try:
                self._admit(waiting.seq, waiting.generated, waiting.future.result())
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - a Rust panic in llguidance is a BaseException
                message = (
                    str(exc)
                    if isinstance(exc, InvalidRequestError)
                    else (f"the request's grammar does not compile: {type(exc).__name__}: {exc}")
                )
                refused.append(self._failed_output(waiting.seq, message, refused=True))  # it holds no blocks
        return refused

    def _check_token_ids(self, ids: list[int], what: str) -> None:
        vocab = self.model_config.vocab_size
        if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab):
            return  # all plain ints in range, seen at C speed (the list below is ~0.1 ms a 1,024 ids)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"{what} token ids must be integers in [0, {vocab}); got {bad[:5]!r}"
                + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            )

    def take_loads(self) -> list[KVLoad]:
        """Imports admitted since the last call: fill their blocks, then call ``finish_load``."""
        loads, self._loads = self._loads, []
        return loads

    def finish_load(self, request_id: str, num_tokens: int, token: int | None = None) -> None:
        """The KV of the first ``num_tokens`` tokens of a loading request is in its blocks.

        ``num_tokens`` lies between the tokens its own prefix cache covered and ``import_tokens``
        (a failed copy: pass how far it got; the rest is computed). ``token``: the first token of
        a request admitted with ``await_token`` (required there, refused elsewhere: raises
        InvalidRequestError). For a request aborted while it was loading, this frees its blocks.
        Unknown ids are ignored.
        """
        live = self._seqs.get(request_id)
        if live is not None and live.status is RequestStatus.LOADING:
            if live.awaiting_token != (token is not None):
                wanted = (
                    "its first token: finish_load must bring it"
                    if live.awaiting_token
                    else "no token: finish_load must not bring one"
                )
                raise InvalidRequestError(f"request {request_id!r} awaits {wanted}")
            if token is not None:
                self._check_token_ids([token], "the awaited")
                live.append_token(token)
                live.awaiting_token = False
                if live.generator is not None and not live.params.is_greedy:
                    Sampler.skip_draws(live.generator, 1)
        seq = live or self.scheduler.abandoned.get(request_id)
        blocks = self._load_blocks.pop(request_id, None)
        if blocks and self.mirror is not None and request_id in self._seqs:
            self.mirror.from_host(blocks)  # the blocks a copy may have reached (the rest is computed)
        if seq is not None:
            self.scheduler.finish_load(seq, num_tokens)
            if seq.num_cached_tokens is not None and seq.status is RequestStatus.RUNNING:
                seq.num_cached_tokens = num_tokens

    def release(self, request_id: str) -> bool:
        """Free the blocks of a held prefill-only request; False if it holds none."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.release(seq)
        return True

    @property
    def root_key(self) -> bytes:
        """The parent of block 0's key for this model (peers must compute the same keys)."""
        return self._root_key

    @property
    def num_held(self) -> int:
        return len(self._held)

    def queue_snapshot(self) -> tuple[list[list[Any]], list[list[int]]]:
        """(prefill work left: [prompt_len, reused, computed, request_id, priority, admitted] per
        request not yet past its prompt -- admitted: its blocks taken, its chunks run before any
        waiting prompt's -- and decodes: [context_tokens, tokens it may still generate] per running
        sequence) -- the load report's view of this engine."""
        queued: list[list[Any]] = []
        decoding: list[list[int]] = []
        for seq in [c.seq for c in self._compiling.values()] + list(self.scheduler.waiting):
            queued.append([seq.num_tokens, 0, 0, seq.seq_id, seq.priority, False])
        for seq in list(self.scheduler.loading.values()) + self.scheduler.running:
            if seq.num_computed_tokens + 1 < seq.num_tokens:  # still in its prompt (or a recompute)
                reused = seq.num_cached_tokens or 0
                computed = max(0, seq.num_computed_tokens - reused)
                queued.append([seq.num_tokens, reused, computed, seq.seq_id, seq.priority, True])
            else:
                decoding.append([seq.num_tokens, max(0, seq.params.max_tokens - seq.num_output_tokens)])
        return queued, decoding

    def take_cache_events(self) -> list[CacheEvent]:
        """Prefix-cache changes since the last call (with ``block_manager.record_events`` on); with a
        host mirror, the stored blocks are copied there first (the write-behind puts from it)."""
        events = self.block_manager.drain_events()
        if self.mirror is not None:
            self.mirror.to_host([e.block_id for e in events if e.stored])
        return events

    def abort_request(self, request_id: str) -> None:
        """Drop a request now and free its blocks (held ones too); no further output is produced for it.

        A loading request keeps its blocks until ``finish_load`` (a copy may still be writing them).
        Unknown: no-op.
        """
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(seq)
        elif self._compiling.pop(request_id, None) is None:
            self.release(request_id)

    def abort_all(self) -> list[str]:
        """Abort every unfinished request and free its blocks; return their ids."""
        ids = list(self._seqs) + list(self._compiling)
        for request_id in ids:
            self.abort_request(request_id)
        return ids

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has anything to do: requests to step, or grammars compiling."""
        return self.scheduler.has_unfinished() or bool(self._compiling)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return an output for every request that got a token or failed.

        If anything raises inside the step, the outputs produced before the failure are returned,
        followed by a failed output for every request of the step that had not finished (see the
        module docstring). Raises EngineBrokenError if the block pool is inconsistent afterwards.
        What ``on_loads`` raises is the caller's failure, not the step's: it is not contained.
        """
        outputs = self._admit_compiled() if self._compiling else []
        batch: ScheduledBatch | None = None
        try:
            batch = self.scheduler.schedule()
            self._loads.extend(batch.loads)
            if self.mirror is not None:
                self._load_blocks.update(
                    (load.seq_id, load.block_ids) for load in batch.loads if load.block_ids
                )
        except Exception as exc:  # noqa: BLE001 - contained: the step's requests fail, the engine goes on
            return outputs + self._fail_step(batch, exc)
        if self.on_loads is not None and self._loads:
            self.on_loads(self.take_loads())
        if batch.is_empty:
            return outputs
        try:
            self._run(batch, outputs)
        except Exception as exc:  # noqa: BLE001 - contained, as above
            outputs += self._fail_step(batch, exc)
            return outputs
        ran = [out for out in outputs if not out.refused]
        if ran and all(out.failed for out in ran):
            self.consecutive_failed_steps += 1  # the model answered, but with nothing usable
        else:
            self.consecutive_failed_steps = 0
        return outputs

    def _threads_for(self, batch: ScheduledBatch) -> contextlib.AbstractContextManager[None]:
        """The torch threads ``batch`` runs on: for a wide step on CPU, the CPUs no other engine
        computes on, up to ``prefill_threads`` (yutu.engine.cpus); otherwise the process's."""
        if self.wide_step_threads is None or not is_wide(batch):
            return contextlib.nullcontext()
        self.last_wide_threads = self.wide_step_threads.pick(torch.get_num_threads())
        # bound to CPUs only for a short chunk after a long prefix: there a stall is most of the step
        # (1P+1D, 128 tokens after 896 cached: 14 of 48 steps at 33-42 ms unbound, ~8 bound, none
        # slow); a 1,024-token step was no faster bound (four pairs, 40.5-44.6 against 35.8-48.1 ms)
        short = batch.num_tokens < WIDE_STEP_TOKENS
        return wide_step_threads(self.last_wide_threads, self._native if short else None)

    def _run(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> None:
        """Compute ``batch``, sample, and append to ``outputs`` (as it goes: kept if a later part raises)."""
        started = time.perf_counter()
        scored = [i for i, c in enumerate(batch.chunks) if self._scores_prompt(c)]  # prompt logprobs
        with self._threads_for(batch):
            logits = self.runner.run(batch, scored)  # (R, V) for chunks with sample set, in order
        for i in scored:
            self._prompt_logprobs(batch.chunks[i], self.runner.last_hidden[i])
        sampled = [self._seqs[c.seq_id] for c in batch.chunks if c.sample]
        histories = [self._history(s) for s in sampled]
        bitmask, grammar_failed = self._bitmask(sampled)
        result = self.sampler.sample(
            logits, [s.params for s in sampled], [s.generator for s in sampled], histories, bitmask
        )
        self._record(batch, time.perf_counter() - started)
        # Fail non-finite rows before the prefix cache learns their blocks: their KV is suspect.
        nonfinite = {sampled[r].seq_id for r in result.nonfinite_rows}
        if nonfinite:
            self.last_failure = f"non-finite logits from the model for {len(nonfinite)} request(s)"
            log.error("the model produced non-finite logits; failing %s", sorted(nonfinite))
        failed = {seq_id: NONFINITE_LOGITS for seq_id in nonfinite} | grammar_failed
        for seq_id, message in failed.items():
            outputs.append(self._fail(self._seqs[seq_id], message, refused=seq_id in grammar_failed))
        self.scheduler.update_after_step(batch.without(set(failed)))
        for seq, token, logprobs in zip(sampled, result.token_ids, result.logprobs, strict=True):
            if token is not None and seq.seq_id not in failed:
                outputs.append(self._append(seq, token, logprobs))

    def _bitmask(self, sampled: list[Sequence]) -> tuple[torch.Tensor | None, dict[str, str]]:
        """The tokens each of ``sampled`` with a grammar may take next, one bitmask row per
        sequence (None when none has a grammar); and the requests whose grammar gave up, with why
        (the request's fault: GrammarFailed)."""
        if all(seq.grammar is None for seq in sampled):
            return None, {}
        bitmask = torch.full((len(sampled), self.grammars.bitmask_words), -1, dtype=torch.int32)
        failed: dict[str, str] = {}
        for row, seq in enumerate(sampled):
            if seq.grammar is not None:
                try:
                    seq.grammar.fill_bitmask(bitmask[row])
                except GrammarFailed as exc:
                    failed[seq.seq_id] = str(exc)
        return bitmask, failed

    def _history(self, seq: Sequence) -> TokenHistory | None:
        """What the sampler needs to adjust ``seq``'s logits this step (None: nothing to adjust):
        its tokens, and the tokens it may not be given: while fewer than ``min_tokens`` are out,
        those that would end it; and its bad words' (:func:`banned_by_bad_words`)."""
        if seq.token_array is None:
            return None
        params = seq.params
        held_back: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens:
            ends = params.stop_token_ids + (() if params.ignore_eos else self.model_config.eos_token_ids)
            held_back = tuple(t for t in ends if t < self.model_config.vocab_size)  # others never come
        if params.bad_words:
            held_back += banned_by_bad_words(params.bad_words, seq.token_array, seq.num_prompt_tokens)
        return TokenHistory(seq.token_array, seq.num_prompt_tokens, held_back)

    def _scores_prompt(self, chunk: ScheduledChunk) -> bool:
        """Whether ``chunk`` computes rows whose logits give prompt logprobs its request asked for:
        the row at position p scores prompt token p + 1."""
        seq = self._seqs.get(chunk.seq_id)
        return seq is not None and seq.prompt_logprobs is not None and chunk.start < seq.num_prompt_tokens - 1

    def _prompt_logprobs(self, chunk: ScheduledChunk, hidden: torch.Tensor) -> None:
        """Add to the request's prompt logprobs those of the prompt tokens ``chunk``'s rows score
        (``hidden``: the chunk's hidden states), PROMPT_LOGPROBS_ROWS rows' logits at a time."""
        seq = self._seqs[chunk.seq_id]
        assert seq.prompt_logprobs is not None
        del seq.prompt_logprobs[chunk.start + 1 :]  # a prompt computed again (preempted) starts over
        k = seq.params.prompt_logprobs or 0
        end = min(chunk.context_len, seq.num_prompt_tokens - 1)  # rows [start, end) score tokens start+1..end
        for first in range(chunk.start, end, PROMPT_LOGPROBS_ROWS):
            last = min(end, first + PROMPT_LOGPROBS_ROWS)
            logits = self.runner.logits_of(hidden[first - chunk.start : last - chunk.start])  # (n, V)
            seq.prompt_logprobs += token_logprobs(logits, seq.token_ids[first + 1 : last + 1], k)

    def _record(self, batch: ScheduledBatch, seconds: float) -> None:
        """Charge each prompt chunk its share of the step's time, by tokens (a decode is one), and
        remember what the step did (load reports). Shares, not the whole step: four prompts
        computed in one step would each report the four's time, and the conductor's cost model,
        which adds the prompts queued on an instance one after another, would learn a prompt
        costs four times what it does."""
        decodes = prefill_tokens = kv_tokens = 0
        per_token = seconds / max(1, batch.num_tokens)
        for chunk in batch.chunks:
            if chunk.num_tokens == 1 and chunk.sample and chunk.start > 0:
                decodes += 1
                kv_tokens += chunk.context_len
            else:
                prefill_tokens += chunk.num_tokens
                seq = self._seqs.get(chunk.seq_id) or self._held.get(chunk.seq_id)
                if seq is not None:
                    seq.prefill_compute_s += per_token * chunk.num_tokens
        self.last_step = StepRecord(decodes, kv_tokens, prefill_tokens, seconds)

    def _fail_step(self, batch: ScheduledBatch | None, exc: Exception) -> list[RequestOutput]:
        """Fail the unfinished requests of a step that raised; ``batch`` is None if scheduling raised."""
        self._failed_steps_total += 1
        self.consecutive_failed_steps += 1
        self.last_failure = f"{type(exc).__name__}: {exc}"
        if batch is None:  # whatever schedule() may have touched: all but the waiting queue
            waiting = set(map(id, self.scheduler.waiting))
            victims = [s for s in self._seqs.values() if id(s) not in waiting]
        else:
            victims = [self._seqs[c.seq_id] for c in batch.chunks if c.seq_id in self._seqs]
        log.exception("engine step failed; aborting its %d unfinished request(s)", len(victims))
        message = (
            f"engine step failed: {self.last_failure}; the request was aborted. This is an engine failure,"
            " not a problem with the request: retry it"
        )
        failures = [self._fail(seq, message) for seq in victims]
        try:
            self.block_manager.check_integrity()
        except AssertionError as err:
            raise EngineBrokenError(f"the KV block pool is inconsistent after a failed step: {err}") from exc
        return failures

    def _fail(self, seq: Sequence, message: str, refused: bool = False) -> RequestOutput:
        """Abort ``seq``, free its blocks, and return its failed output (``refused``: the request's
        own fault, its grammar's, not counted as the engine's failure)."""
        self.scheduler.abort(seq)
        del self._seqs[seq.seq_id]
        if not refused:
            self._failed_requests_total += 1
        return self._failed_output(seq, message, refused)

    @staticmethod
    def _failed_output(seq: Sequence, message: str, refused: bool) -> RequestOutput:
        return RequestOutput(
            request_id=seq.seq_id,
            new_token_ids=[],
            new_logprobs=None if seq.params.logprobs is None else [],
            finished=True,
            finish_reason=FinishReason.ABORT,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            error=message,
            refused=refused,
        )

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        try:
            seq.append_token(token)
        except GrammarFailed as exc:  # its grammar gave up on a token its mask allowed (a limit)
            return self._fail(seq, str(exc), refused=True)
        except InvalidRequestError as exc:  # a sampled token its mask did not allow: the mask failed
            log.error("request %s: %s", seq.seq_id, exc)
            return self._fail(seq, f"the sampled token broke the request's grammar: {exc}")
        self._generation_tokens_total += 1
        params = seq.params
        status: RequestStatus | None = None
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.model_config.eos_token_ids
        ):
            status = RequestStatus.FINISHED_STOPPED
        elif seq.grammar is not None and seq.grammar.is_done:  # complete: nothing may follow but eos
            status = RequestStatus.FINISHED_STOPPED
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None  # sent once, with the first token
        kv_held: HeldKV | None = None
        if status is not None:
            self.scheduler.finish(seq, status)
            del self._seqs[seq.seq_id]
        elif seq.prefill_only:  # first token sampled: keep the KV of the prompt for a peer to read
            self.scheduler.hold(seq)
            del self._seqs[seq.seq_id]
            self._held[seq.seq_id] = seq
            kv_held = HeldKV(self.block_manager.block_table(seq.seq_id), seq.num_computed_tokens)
            if self.mirror is not None:
                self.mirror.to_host(kv_held.block_ids)  # before a peer hears of them
        return RequestOutput(
            request_id=seq.seq_id,
            new_token_ids=[token],
            new_logprobs=None if logprobs is None else [logprobs],
            finished=status is not None or kv_held is not None,
            finish_reason=None if status is None else status.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            kv_held=kv_held,
            prefill_s=seq.prefill_compute_s if seq.num_output_tokens == 1 else None,
            prompt_logprobs=prompt_logprobs,
        )

    # ------------------------------------------------------------------ introspection

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._compiling),
            num_kv_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            kv_usage=bm.usage,
            prefix_cache_queries_tokens=bm.prefix_cache_queries_tokens,
            prefix_cache_hit_tokens=bm.prefix_cache_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_loading=len(self.scheduler.loading),
            num_held=len(self._held),
            failed_steps_total=self._failed_steps_total,
            failed_requests_total=self._failed_requests_total,
            num_prefilling=self.scheduler.num_prefilling,
        )
