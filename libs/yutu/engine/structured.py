"""Structured outputs: a request's grammar as a mask over the next token's logits.

A request with ``SamplingParams.grammar`` (an llguidance grammar: a JSON schema, a regex, a choice
or a Lark grammar compiled by :func:`grammar_from`) gets a :class:`Grammar`, a matcher that follows
its output token by token. Before each sample the engine asks every such row's matcher which tokens
may come next (one bit per token, :meth:`Grammar.fill_bitmask`), and the sampler keeps only those
(:func:`mask_rows_`): a disallowed token's score is float32's lowest, an allowed one's at least the
next value up, so the row stays finite (the native greedy pass reads it as it is) and a disallowed
token is never the first maximum nor drawn (its probability is 0). The mask comes last, after the
bias, the penalties and ``min_tokens``' hold on the eos tokens: where the grammar allows nothing but
an eos token, the grammar wins. A request ends (``stop``) once its grammar is complete and allows no
further token (:attr:`Grammar.is_done`), eos or not.
On the CPU the sampler masks with the native kernel (``mask_rows_``, csrc/sampling.cpp: 16 rows of
a 128k vocabulary in ~1 ms against ~16 ms here); :func:`mask_rows_` here is the reference, equal
bit for bit in a test, and what runs on other devices.

llguidance (Microsoft's grammar engine, one of vLLM's structured-output backends) computes a mask
in ~2-12 us at the demo model's 2,560 tokens; a request's matcher is a copy of a per-grammar
pristine one (:class:`Grammars` caches 64, of up to 4 MiB of grammar text in all), made in
microseconds. Compiling a grammar the cache lacks takes longer -- ~9 ms for 28 KB of JSON schema,
~0.8 s for 630 KB -- and releases the GIL, so it runs on a thread of its own
(:meth:`Grammars.compile`) while the engine steps the other requests; the request waits for it
outside the scheduler (``LLMEngine.add_request``). Its tokenizer view is built once per engine,
from the checkpoint's ``tokenizer.json``, when the engine starts (that holds the GIL).

Nothing here depends on where the matcher lives: a decode instance or a migrated request rebuilds
it by replaying the tokens generated so far (``LLMEngine.add_request(generated=...)``), so the
constraint holds across the prefill/decode split.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import llguidance
import torch

from yutu.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

_FLOAT32_LOWEST = torch.finfo(torch.float32).min
# The least score an allowed token keeps: one step above a disallowed token's, so it always wins.
_ALLOWED_FLOOR = float(torch.nextafter(torch.tensor(_FLOAT32_LOWEST), torch.tensor(0.0)))

K = TypeVar("K")
V = TypeVar("V")
GrammarKind = Literal["json_schema", "regex", "choice", "grammar"]
GRAMMAR_CACHE_SIZE = 64  # pristine matchers kept per engine, by grammar
# ... and at most this much grammar text among them: a matcher takes ~50-70x its grammar's text in
# memory (measured: 40 grammars of 6 KB, 15 MB; 10 of 57 KB, 28 MB), so a client sending large
# schemas, each new, cannot grow an engine by more than ~0.3 GB through the cache.
GRAMMAR_CACHE_BYTES = 4 * 2**20
# vLLM-compatible: compact JSON (", " and ": " between items, no other whitespace: xgrammar's
# separators without any_whitespace), so a small or undertrained model cannot fill its budget with
# spaces and newlines between the values.
_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_WHITESPACE = r"[\x20\x0A\x0D\x09]*"  # a whitespace pattern: JSON's own, anywhere JSON allows it


def grammar_from(kind: GrammarKind, spec: Any, whitespace: str | None = None) -> str:
    """The llguidance grammar for ``spec``: a JSON schema (a dict, or its JSON text), a regex, a list
    of choices (strings), or a Lark / GBNF grammar. Raises ValueError naming what is wrong when it
    does not compile (the grammar is checked here, without a tokenizer).

    ``whitespace``, for a JSON schema only: the regex of the whitespace allowed between its tokens
    (vLLM's ``whitespace_pattern``; :data:`ANY_WHITESPACE` for JSON's own), after "," and ":"
    alone; None: compact JSON."""
    if whitespace is not None and kind != "json_schema":
        raise ValueError("a whitespace pattern applies to JSON output (a schema or any JSON object) only")
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(spec, dict | bool):
            raise ValueError(f"a JSON schema is an object (or true/false), got {type(spec).__name__}")
        options: JsonCompileOptions = (
            _JSON_OPTIONS if whitespace is None else {"whitespace_pattern": whitespace}
        )
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec), defaults=options)
    elif kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ValueError("a regex is a non-empty string")
        grammar = llguidance.LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise ValueError("choices are a non-empty list of non-empty strings")
        grammar = llguidance.grammar_from("choice", json.dumps(spec))
    elif kind == "grammar":
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError("a grammar is a non-empty string (Lark or GBNF)")
        grammar = llguidance.grammar_from("grammar", spec)
    else:
        raise ValueError(f"unknown grammar kind {kind!r}")
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(problem.strip())
    return grammar


class LRUCache(Generic[K, V]):
    """At most ``entries`` items, and at most ``max_bytes`` of their ``cost``: the least recently
    used go first (the newest stays, however costly). Not thread-safe."""

    def __init__(self, entries: int, max_bytes: int, cost: Callable[[K, V], int]) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self._cost = cost
        self._items: OrderedDict[K, V] = OrderedDict()
        self.bytes = 0  # the cost of what it holds

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= self._cost(key, old)
        self._items[key] = value
        self.bytes += self._cost(key, value)
        while len(self._items) > self.entries or (self.bytes > self.max_bytes and len(self._items) > 1):
            evicted = self._items.popitem(last=False)
            self.bytes -= self._cost(*evicted)


class GrammarFailed(InvalidRequestError):
    """A request's grammar gave up: its parser refused a token its own mask allowed, or could not
    compute a mask -- a resource limit of llguidance's (an object of hundreds of optional
    properties, say). The request's own fault, not the engine's."""


class Grammar:
    """One request's matcher: which tokens may come next, and the tokens it has taken.

    ``after_thinking`` (a reasoning model's ``(start, end, opened)`` markers, SamplingParams'
    ``grammar_after_thinking``): the model thinks unconstrained first -- from the first token if
    ``opened`` (its prompt ended in ``start``), else if its first token is ``start``, which that
    token's mask allows beside the grammar's -- and the grammar holds from the token after ``end``.
    """

    def __init__(
        self, matcher: llguidance.LLMatcher, after_thinking: tuple[int, int, bool] | None = None
    ) -> None:
        self._matcher = matcher
        self._mask: torch.Tensor | None = None  # the bitmask row fill_bitmask last wrote
        self._markers = None if after_thinking is None else after_thinking[:2]
        self._state = "answering"  # the grammar holds; else "thinking", or "undecided" (first token)
        if after_thinking is not None:
            self._state = "thinking" if after_thinking[2] else "undecided"

    def advance(self, token: int) -> None:
        """Take ``token``, the request's next output token. Raises InvalidRequestError if the
        grammar does not allow it (GrammarFailed if the mask last filled allowed it: the grammar
        gave up); the matcher is then broken, and so is its request (every caller refuses or fails
        it): one call per token, no check before it."""
        if self._state != "answering":
            assert self._markers is not None
            start, end = self._markers
            if self._state == "thinking":  # every token is the thinking's, the end marker its last
                self._state = "answering" if token == end else "thinking"
                self._mask = None
                return
            if token == start:  # the first token opens the thinking
                self._state = "thinking"
                self._mask = None
                return
            self._state = "answering"  # no thinking: the grammar takes the first token
        mask, self._mask = self._mask, None
        if self._matcher.consume_token(token):
            return
        problem = self._problem()
        if mask is not None and int(mask[token // 32]) >> (token % 32) & 1:
            raise GrammarFailed(f"the request's grammar failed at token {token}: {problem}")
        raise InvalidRequestError(f"token {token} does not follow the request's grammar here ({problem})")

    def _problem(self) -> str:
        """The matcher's error, its first line (the rest is its state: long, and the grammar's)."""
        return self._matcher.get_error().split("\n", 1)[0]

    @property
    def is_done(self) -> bool:
        """The output is complete: the grammar allows no further token (only an eos)."""
        return self._state == "answering" and self._matcher.is_stopped()

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write into ``row`` (int32, contiguous, on the CPU; one bit per token, token t at bit
        t % 32 of word t // 32) which tokens may come next."""
        assert row.dtype == torch.int32 and row.is_contiguous() and row.device.type == "cpu"
        if self._state == "thinking":
            row.fill_(-1)  # every token
            return
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self._matcher.is_error():  # a resource limit of a pathological grammar
            raise GrammarFailed(f"the request's grammar failed: {self._problem()}")
        if self._state == "undecided":  # the first token may open the thinking instead
            assert self._markers is not None
            start = self._markers[0]
            word = int(row[start // 32]) | 1 << start % 32
            row[start // 32] = word - 2**32 if word >= 2**31 else word  # as int32
        self._mask = row


class Grammars:
    """Builds the matchers of one model's requests.

    Its tokenizer view is built here, with the engine: ~0.01 s for the demo model's 2,560 tokens,
    ~0.9 s for 128,256 (bench_sampler.py), holding the GIL throughout, so that no step waits on it
    later. A checkpoint it cannot be built for serves everything but constrained requests, which
    are refused with the reason."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._pristine: LRUCache[str, llguidance.LLMatcher] = LRUCache(
            GRAMMAR_CACHE_SIZE, GRAMMAR_CACHE_BYTES, lambda grammar, _: len(grammar)
        )
        self._compiling: dict[str, Future[llguidance.LLMatcher]] = {}  # started, not yet cached
        self._pool: ThreadPoolExecutor | None = None  # the compiling thread, started with the first
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._problem = ""  # why there is no tokenizer view
        path = Path(model_dir) / "tokenizer.json"
        eos = [t for t in eos_token_ids if t < vocab_size]
        if not path.is_file():
            self._problem = "structured outputs need the model's tokenizer.json, which this checkpoint lacks"
        elif not eos:
            self._problem = "structured outputs need the model's eos token id, which its config lacks"
        else:
            try:
                self._tokenizer = llguidance.LLTokenizer(
                    path.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=eos
                )
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - e.g. a tokenizer larger than the vocabulary;
                # a Rust panic in llguidance is a BaseException too, and must not stop the engine
                self._problem = f"structured outputs cannot use this model's tokenizer: {exc}"

    @property
    def bitmask_words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.vocab_size + 31) // 32

    def _tokenizer_view(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            raise InvalidRequestError(self._problem)
        return self._tokenizer

    def is_compiled(self, grammar: str) -> bool:
        """Whether :meth:`matcher` has ``grammar`` at hand (else it compiles it). Raises
        InvalidRequestError if this model cannot take grammars at all."""
        self._tokenizer_view()
        return grammar in self._pristine

    def compile(self, grammar: str) -> Future[llguidance.LLMatcher]:
        """Start compiling ``grammar`` on the compiling thread (or join the compile already under
        way); pass the future's result to :meth:`matcher` once it is done. Requests of grammars
        the cache lacks wait for this instead of holding up the step (compiles release the GIL)."""
        tokenizer = self._tokenizer_view()
        for started in [g for g, future in self._compiling.items() if future.done() and g != grammar]:
            del self._compiling[started]  # its requests hold the future (if all were aborted: none)
        future = self._compiling.get(grammar)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="yutu-grammar")
            future = self._pool.submit(_compile, tokenizer, grammar)
            self._compiling[grammar] = future
        return future

    def matcher(
        self,
        grammar: str,
        compiled: llguidance.LLMatcher | None = None,
        after_thinking: tuple[int, int, bool] | None = None,
    ) -> Grammar:
        """A fresh matcher of ``grammar``: a copy of the cached one, else of ``compiled`` (a
        :meth:`compile` result), else compiled here, on the caller's thread (the plain path);
        ``after_thinking``: see :class:`Grammar`. Raises InvalidRequestError if it does not compile."""
        pristine = self._pristine.get(grammar)
        if pristine is None:
            pristine = compiled if compiled is not None else _compile(self._tokenizer_view(), grammar)
            if pristine.is_error():
                raise InvalidRequestError(f"the request's grammar does not compile: {pristine.get_error()}")
            self._pristine.put(grammar, pristine)
        return Grammar(pristine.deep_copy(), after_thinking)


def _compile(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A pristine matcher of ``grammar``; one that does not compile says so (``is_error``)."""
    return llguidance.LLMatcher(tokenizer, grammar, log_level=0)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 bitmasks as (R, vocab_size) bools: token t allowed iff bit t % 32 of word t // 32."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (R, W, 32)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def mask_rows_(scores: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """Keep only the allowed tokens of ``scores``' ``rows`` (in place): a disallowed token's score
    becomes float32's lowest, an allowed one's at least :data:`_ALLOWED_FLOOR`. ``bitmask``: one
    (W,) row per entry of ``rows``, in order."""
    if not rows:
        return
    index = torch.tensor(list(rows), device=scores.device)
    allowed = unpack_bitmask(bitmask.to(scores.device), scores.shape[1])  # (len(rows), V)
    masked = torch.where(allowed, scores[index].clamp(min=_ALLOWED_FLOOR), _FLOAT32_LOWEST)
    scores[index] = masked
