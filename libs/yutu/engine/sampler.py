"""Turn logits into tokens: logit bias and penalties, allowed tokens, greedy, temperature, min-p,
top-k, top-p, per-request seeds, and logprobs.

A request's ``logit_bias`` and its repetition, frequency and presence penalties change its row
first, in that order (vLLM's; :func:`adjust_logits`), from the tokens of its prompt and output so
far; then every token outside its ``allowed_token_ids`` is masked, and so are the tokens the engine
holds back this step (its eos and stop tokens while fewer than its ``min_tokens`` are out, the last
token of a bad word whose rest the output ends with); a row with a grammar then keeps only the
tokens it allows (:mod:`yutu.engine.structured`). Greedy and random rows alike are chosen from the
changed row.

A random row is drawn by inverse transform from one uniform (:func:`draw_from`); min-p, top-k and
top-p run only for rows that ask for them, min-p first (:func:`apply_min_p`, vLLM's order), top-k
and top-p on each row's largest values where those decide it (:func:`top_k_top_p`;
:func:`apply_top_k_top_p`, which sorts the whole row, is the reference).

All maths runs in float32 on the logits' device (a draw's running sum in float64).
Reproducibility: a request with ``params.seed`` owns a ``torch.Generator`` and its row is sampled
alone from it, one draw per generated token, so its tokens do not depend on what else is in the
batch. Requests without a seed share torch's default RNG.
Logprobs are ``log_softmax`` of the raw logits (before bias, penalties, temperature, top-k and
top-p), like OpenAI and vLLM.

Numerical contract: for valid :class:`SamplingParams` the sampler never meets NaN.

- A logits row with any non-finite value (NaN, +-inf: a model failure) gets no token: its entry in
  ``SamplerOutput.token_ids`` is None and the caller fails that request. The row is replaced by zeros
  before any maths, so it cannot disturb the others (a NaN in a row's cumulative sum would make its
  draw meaningless; sampling ops on CUDA trip a device-side assert on it that poisons the context).
- A bias or a penalty is clamped into float32's finite range where it lands, so an adjusted row
  stays finite (a repetition penalty near 0 would otherwise divide a logit to infinity).
- ``logits / temperature`` (temperature >= GREEDY_TEMPERATURE) can overflow for huge finite logits; a
  row whose largest scaled value is not finite is scaled as ``(logits - max) / temperature``
  instead, so its most likely token scores exactly 0. Other rows are computed as before, bit for bit.
- The most likely token is never masked by top-k or top-p, so every row keeps a finite maximum and a
  softmax with a positive mass.
- Logprobs are finite: a ``-inf`` (only from an extreme logit range) is reported as float32's lowest.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch

from yutu.engine.outputs import TokenLogprobs
from yutu.engine.sampling import SamplingParams
from yutu.engine.structured import mask_rows_

_FLOAT32_LOWEST = torch.finfo(torch.float32).min
_FLOAT32_MAX = torch.finfo(torch.float32).max


class TokenHistory(NamedTuple):
    """What a row's penalties look at: its request's tokens (prompt, then output) so far; and the
    tokens it may not be given this step (``min_tokens`` not reached: its eos and stop tokens; a bad
    word's last token where the output ends with the rest of it), repeats allowed."""

    token_ids: Sequence[int]
    num_prompt_tokens: int
    held_back: Sequence[int] = ()


def banned_by_bad_words(
    words: Sequence[Sequence[int]], token_ids: Sequence[int], num_prompt_tokens: int
) -> tuple[int, ...]:
    """The tokens ``words`` (each a non-empty token-id sequence) ban next, after ``token_ids``
    (prompt, then output): a word's last token where the output ends with the word's other tokens
    (vLLM's ``apply_bad_words``). A one-token word is always banned; only the output counts, never
    the prompt: a word longer than the output plus one cannot match. Repeats are kept."""
    num_output = len(token_ids) - num_prompt_tokens
    end = len(token_ids)
    return tuple(
        word[-1]
        for word in words
        if len(word) - 1 <= num_output and tuple(token_ids[end - len(word) + 1 : end]) == tuple(word[:-1])
    )


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int | None]  # (R,) one sampled token per logits row; None: the row was not finite
    logprobs: list[TokenLogprobs | None]  # (R,) None where params.logprobs is None or no token

    @property
    def nonfinite_rows(self) -> list[int]:
        """Rows whose logits held NaN or inf: no token was sampled for them."""
        return [r for r, token in enumerate(self.token_ids) if token is None]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p sets; returns a new tensor.

    logits: (R, V) float32 with a finite maximum per row; top_k: (R,) int64 in [1, V] (V disables);
    top_p: (R,) float32 in (0, 1] where 1 disables. The most likely token is never masked (rank 0 is
    kept explicitly, whatever rounding or a flushed subnormal top_p would say).
    """
    num_rows, vocab = logits.shape
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # (R, V) each
    ranks = torch.arange(vocab, device=logits.device).expand(num_rows, vocab)  # (R, V)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # (R, V)
    mass_before = probs.cumsum(dim=-1) - probs  # (R, V) probability of strictly more likely tokens
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


TOP_CANDIDATES = 1024  # a row's largest logits that top_k_top_p looks at first


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """:func:`apply_top_k_top_p`, from each row's largest values where they decide it.

    The plain version sorts every row's whole vocabulary (~11 ms for one row of a 128k vocabulary
    on one CPU thread); ``topk`` of its TOP_CANDIDATES largest values takes ~0.7 ms. A row is
    decided by them when its top-k set lies among them (``top_k`` at most their number), or when
    top-p already drops the last of them (every smaller value is dropped too: the mass before it
    only grows). The mass is each candidate's probability in the row's top-k distribution, its
    normaliser a logsumexp over the top-k set (over the whole row when top-k is off). Rows not
    decided -- a flat distribution whose top_p mass spreads wider -- go through the plain version;
    so does everything when the candidates would be a quarter of the vocabulary or more.
    """
    num_rows, vocab = logits.shape
    k_max = int(top_k.max())
    count = min(vocab, max(TOP_CANDIDATES, k_max if k_max < vocab else 0))
    if count * 4 > vocab:
        return apply_top_k_top_p(logits, top_k, top_p)
    values, ids = logits.topk(count, dim=-1)  # (R, C) each, descending
    ranks = torch.arange(count, device=logits.device).expand(num_rows, count)  # (R, C)
    values = values.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))  # outside the top-k sets
    k_inside = top_k <= count  # (R,) the whole top-k set is among the candidates
    norm = values.logsumexp(dim=-1)  # (R,)
    if not bool(k_inside.all()):  # rows with top-k off: their whole row's
        norm = torch.where(k_inside, norm, logits.logsumexp(dim=-1))
    probs = (values - norm.unsqueeze(1)).exp()  # (R, C)
    mass_before = probs.cumsum(dim=-1) - probs  # (R, C)
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1) & (ranks > 0)
    values = values.masked_fill(drop, float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter(-1, ids, values)
    undecided = (~(k_inside | drop[:, -1])).nonzero().squeeze(1)  # (U,)
    if undecided.numel():
        out[undecided] = apply_top_k_top_p(logits[undecided], top_k[undecided], top_p[undecided])
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) every token less than ``min_p`` times as likely as its row's most likely one
    (vLLM's MinPLogitsProcessor). logits: (R, V), temperature applied; min_p: (R,) in [0, 1]. The
    most likely token always stays."""
    probs = logits.softmax(dim=-1)
    floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < floor, float("-inf"))


def scale_by_temperature(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """``logits / temps`` per row, guarded against overflow; returns a new tensor.

    logits: (R, V) finite float32; temps: (R,) float32 > 0. A row whose scaled maximum is not finite
    (a huge logit over a small temperature) is computed as ``(logits - max) / temp``: its maximum is
    then exactly 0 and the rest are finite or -inf, so its softmax is defined. Other rows are exactly
    ``logits / temp``.
    """
    temps = temps.unsqueeze(1)  # (R, 1)
    scaled = logits / temps  # (R, V)
    overflow = ~scaled.amax(dim=-1, keepdim=True).isfinite()  # (R, 1)
    if not bool(overflow.any()):  # the usual case: no second pass over the vocabulary
        return scaled
    shifted = (logits - logits.amax(dim=-1, keepdim=True)) / temps  # (R, V)
    return torch.where(overflow, shifted, scaled)


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (R, V), by inverse transform: the first token whose cumulative
    probability exceeds ``uniforms`` (R,) in [0, 1) times the row's total.

    A token of probability 0 is never drawn (its cumulative sum equals the one before it), the sum
    runs in float64 (a 128k vocabulary's float32 running sum drifts ~1e-5), and ``u * total`` stays
    below the total for u < 1, so every row has an answer. One uniform per row: ``torch.multinomial``
    draws an exponential for every token of the row (~25 ns each on a CPU, 50 ms a step for 16 rows
    of a 128k vocabulary); this is one cumulative sum and a binary search.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # (R, V) (2x faster than cumsum(dtype=) on CPU)
    targets = uniforms.to(torch.float64) * cdf[:, -1]  # (R,)
    return torch.searchsorted(cdf, targets.unsqueeze(1), right=True).squeeze(1)  # (R,)


def token_tensor(token_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``token_ids`` as an int64 tensor on ``device``, by way of an ``array`` (``torch.tensor`` of a
    list costs ~120 ns an id, this ~15: a 1,200-token history 145 against 21 us)."""
    if not token_ids:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(array.array("q", token_ids), dtype=torch.long).to(device)


def adjust_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory | None]
) -> torch.Tensor:
    """``logits`` (R, V) with each row's ``logit_bias`` added, then its repetition, frequency and
    presence penalties applied (:class:`SamplingParams`), then every token outside its
    ``allowed_token_ids`` and its held-back tokens set to float32's lowest; a new tensor, rows that
    ask for none unchanged. ``histories[r]`` must be given for every row whose params adjust its
    logits.

    Sparse: a row's work is over the tokens it names or has seen, not its vocabulary (apart from a
    clamp, and a fill where ``allowed_token_ids`` is set). A token seen several times is simply
    indexed several times: a gather then a scatter of the same values (repetition, presence), an
    accumulation (frequency: one penalty per occurrence). An adjusted row is clamped into float32's
    finite range; the masks come after, so no bias or penalty lifts a masked token back up.

    A row whose every token ends up masked (``allowed_token_ids`` all held back by ``min_tokens``,
    say) is all float32's lowest, and nothing special is done: a greedy row takes the first of the
    equal values (token 0), a random one draws as from a flat row (a grammar, applied after, lifts
    its own tokens above the lowest, so it decides between them).
    """
    out = logits.clone()
    device = logits.device
    for r, p in enumerate(params):
        if not p.adjusts_logits:
            continue
        history = histories[r]
        assert history is not None, "a row that adjusts its logits needs its tokens"
        row = out[r]  # (V,) a view: the updates below land in ``out``
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=device)
            row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=device))
        seen = token_tensor(history.token_ids, device)  # (L,) prompt, then output
        if p.repetition_penalty != 1.0:
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        output = seen[history.num_prompt_tokens :]  # (O,)
        if p.frequency_penalty and output.numel():
            row.index_add_(0, output, torch.full(output.shape, -p.frequency_penalty, device=device))
        if p.presence_penalty and output.numel():
            row[output] = row[output] - p.presence_penalty
        row.clamp_(_FLOAT32_LOWEST, _FLOAT32_MAX)  # a pass over the row: cheaper than over what was touched
        if p.allowed_token_ids is not None:
            allowed = token_tensor(p.allowed_token_ids, device)  # (A,)
            kept = row[allowed]  # (A,)
            row.fill_(_FLOAT32_LOWEST)
            row[allowed] = kept
        if history.held_back:
            row[torch.tensor(list(history.held_back), device=device)] = _FLOAT32_LOWEST
    return out


def adjust_logits_native(
    kernels: ModuleType,
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
) -> torch.Tensor:
    """:func:`adjust_logits` on CPU with the native kernels: the rows' biases in one ``index_add_``,
    their penalties in one ``adjust_rows_`` call over their tokens laid end to end (a history kept
    as an ``array`` is copied, not converted), then the masks in torch. The same values, bit for
    bit (a test holds it)."""
    out = logits.clone()  # (R, V)
    vocab = logits.shape[1]
    rows = [r for r, p in enumerate(params) if p.adjusts_logits]
    bias_keys = [r * vocab + t for r in rows for t, _ in params[r].logit_bias]
    if bias_keys:
        bias = torch.tensor([b for r in rows for _, b in params[r].logit_bias])
        out.view(-1).index_add_(0, torch.tensor(bias_keys), bias)
    tokens = array.array("q")
    offsets, prompts, penalties, held_back = [0], [], [], []
    for r in rows:
        history = histories[r]
        assert history is not None, "a row that adjusts its logits needs its tokens"
        held_back += [r * vocab + t for t in history.held_back]
        tokens.extend(history.token_ids)
        offsets.append(len(tokens))
        prompts.append(history.num_prompt_tokens)
        p = params[r]
        penalties.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
    kernels.adjust_rows_(
        out,
        torch.tensor(rows),
        torch.frombuffer(tokens, dtype=torch.long),  # (N,) ours alone: never resized while it is read
        torch.tensor(offsets),
        torch.tensor(prompts, dtype=torch.long),
        torch.tensor(penalties, dtype=torch.float64).reshape(len(rows), 3),
    )
    masked = [r for r in rows if params[r].allowed_token_ids is not None]
    if masked:  # keep the allowed tokens' values, lowest for the rest of those rows
        allowed = [token_tensor(params[r].allowed_token_ids or (), out.device) + r * vocab for r in masked]
        keys = torch.cat(allowed)  # (A,) every masked row's allowed tokens, flat indices end to end
        kept = out.view(-1)[keys]  # (A,)
        out[torch.tensor(masked)] = _FLOAT32_LOWEST
        out.view(-1)[keys] = kept
    if held_back:
        out.view(-1)[torch.tensor(held_back)] = _FLOAT32_LOWEST
    return out


def token_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Row i's logprob of ``targets[i]`` under the raw ``logits`` (n, V), with its rank in the row and
    its ``k`` most likely tokens: a prompt's own tokens' logprobs (the engine's ``prompt_logprobs``).
    A -inf or NaN (a row that is not finite) is reported as float32's lowest."""
    logp = torch.log_softmax(logits.float(), dim=-1).nan_to_num(nan=_FLOAT32_LOWEST, neginf=_FLOAT32_LOWEST)
    picked = logp.gather(1, torch.tensor(list(targets), device=logp.device).unsqueeze(1))  # (n, 1)
    ranks = (logp >= picked).sum(dim=-1).tolist()  # (n,) itself included: 1 is the most likely
    tops: list[list[tuple[int, float]]] = [[] for _ in targets]
    if k:
        values, ids = logp.topk(min(k, logp.shape[1]), dim=-1)  # (n, k) each, best first
        tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return [
        TokenLogprobs(t, lp, top, rank)
        for t, lp, top, rank in zip(targets, picked.squeeze(1).tolist(), tops, ranks, strict=True)
    ]


class RowStats(NamedTuple):
    """Per logits row, from the native ``greedy_rows``: its first maximum, that maximum's value,
    ``log(sum(exp(x - top)))`` (empty when not asked), so a token's logprob is ``(x - top) - log_sum``,
    and whether the row is finite (one that is not has a row of zeros' figures)."""

    token: torch.Tensor  # (R,) int64
    top: torch.Tensor  # (R,) float32
    log_sum: torch.Tensor  # (R,) float32, or (0,)
    finite: torch.Tensor  # (R,) bool


class Sampler:
    """Stateless apart from torch's default RNG; per-request generators are passed in.

    ``kernels``: the native CPU kernels (:mod:`yutu.engine.native`), or None. With them, rows of
    CPU logits get their finiteness, greedy token and the normaliser of their logprobs from
    ``greedy_rows`` (vectorized passes over a row, where torch's ``argmax`` and ``log_softmax`` on
    a CPU are each several times slower than one); torch's operations are the reference, and what
    runs without them, on other devices, and for top-logprobs (``logprobs`` > 0).
    """

    def __init__(self, kernels: ModuleType | None = None) -> None:
        self._kernels = kernels

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[TokenHistory | None] | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` (R, V) with ``params[r]`` and ``generators[r]``;
        ``histories[r]``: the row's tokens so far, needed where ``params[r]`` adjusts its logits;
        ``bitmask`` (R, ceil(V / 32)) int32: the tokens each row with a grammar may take (rows
        without one are not read), needed where any ``params[r].grammar`` is set.

        A row that is not all finite gets ``None`` (see the module docstring); the others are
        sampled as if it were not there, except that unseeded rows share torch's default RNG.
        """
        num_rows, vocab = logits.shape
        assert len(params) == num_rows == len(generators)
        logits = logits.float()
        stats = None
        if self._kernels is not None and logits.device.type == "cpu":
            log_sum = any(p.logprobs is not None for p in params)
            stats = RowStats(*self._kernels.greedy_rows(logits.contiguous(), log_sum))
            finite = stats.finite  # (R,)
        else:
            # A row is finite iff its least and greatest values are (NaN propagates through both):
            # amin and amax are a vectorized pass each (torch.aminmax, one pass, is ~20x slower on CPU).
            finite = logits.amin(dim=-1).isfinite() & logits.amax(dim=-1).isfinite()  # (R,)
        all_finite = bool(finite.all())
        if not all_finite:
            logits = torch.where(finite.unsqueeze(1), logits, 0.0)  # (R, V) bad rows: a harmless uniform row

        adjusted = any(p.adjusts_logits for p in params)
        if adjusted and histories is None:
            raise ValueError(
                "a row with logit_bias, a penalty, allowed_token_ids, bad_words or min_tokens needs its"
                " tokens: pass histories"
            )
        scores = logits  # (R, V) what the rows are chosen from
        best = stats.token if stats is not None else None  # (R,) each row's greedy token, if known
        if adjusted and stats is not None and self._kernels is not None:  # the native kernels, on CPU
            scores = adjust_logits_native(self._kernels, logits, params, histories or ())
            best = self._kernels.greedy_rows(scores, False)[0]  # the adjusted rows' own first maxima
        elif adjusted:
            scores = adjust_logits(logits, params, histories or ())
            best = None
        constrained = [r for r, p in enumerate(params) if p.grammar is not None]
        if constrained:
            if bitmask is None:
                raise ValueError("a row with a grammar needs its allowed tokens: pass bitmask")
            if scores is logits:
                scores = logits.clone()  # the logprobs are the raw logits'
            masks = bitmask if len(constrained) == num_rows else bitmask[constrained]  # (C, W)
            if stats is not None and self._kernels is not None:  # the native kernels, on CPU
                self._kernels.mask_rows_(scores, torch.tensor(constrained), masks.contiguous())
                best = self._kernels.greedy_rows(scores, False)[0]
            else:
                mask_rows_(scores, constrained, masks)
                best = None
        greedy = [r for r, p in enumerate(params) if p.is_greedy]
        if len(greedy) == num_rows:  # the usual batch: no row to pick out
            chosen = best if best is not None else scores.argmax(dim=-1)  # (R,)
        else:
            chosen = torch.empty(num_rows, dtype=torch.long, device=logits.device)  # (R,)
            if greedy:
                rows = torch.tensor(greedy, device=logits.device)
                chosen[rows] = best[rows] if best is not None else scores[rows].argmax(dim=-1)
            random = [r for r, p in enumerate(params) if not p.is_greedy]
            self._sample_random(scores, params, generators, random, chosen)

        token_ids: list[int | None] = list(chosen.tolist())
        if not all_finite:
            for r, ok in enumerate(finite.tolist()):
                if not ok:
                    token_ids[r] = None
        return SamplerOutput(token_ids, self._logprobs(logits, chosen, params, token_ids, stats))

    @staticmethod
    def _sample_random(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        random: list[int],
        chosen: torch.Tensor,
    ) -> None:
        """Write into ``chosen`` a draw for each row of ``random`` (the non-greedy rows)."""
        num_rows, vocab = logits.shape
        rows = torch.tensor(random, device=logits.device)
        temps = torch.tensor([params[r].temperature for r in random], device=logits.device)
        # top_k is clamped in Python: a top_k beyond int64 would not even fit the tensor.
        top_k_list = [min(params[r].top_k or vocab, vocab) for r in random]
        top_k = torch.tensor(top_k_list, device=logits.device)
        top_p = torch.tensor([params[r].top_p for r in random], device=logits.device)
        scaled = scale_by_temperature(logits if len(random) == num_rows else logits[rows], temps)  # (Rr, V)
        with_min_p = [i for i, r in enumerate(random) if params[r].min_p > 0.0]
        if with_min_p:
            idx = torch.tensor(with_min_p, device=logits.device)
            min_p = torch.tensor([params[random[i]].min_p for i in with_min_p], device=logits.device)
            scaled[idx] = apply_min_p(scaled[idx], min_p)
        # Only rows that restrict the choice pay for top-k/top-p (a row with neither restriction
        # would come out of it unchanged, bit for bit).
        restricted = [i for i, r in enumerate(random) if top_k_list[i] < vocab or params[r].top_p < 1.0]
        if len(restricted) == len(random):
            scaled = top_k_top_p(scaled, top_k, top_p)
        elif restricted:
            idx = torch.tensor(restricted, device=logits.device)
            scaled[idx] = top_k_top_p(scaled[idx], top_k[idx], top_p[idx])
        probs = scaled.softmax(dim=-1)  # (Rr, V)
        uniforms = torch.rand(len(random), device=logits.device)  # (Rr,) unseeded rows: torch's RNG
        for i, r in enumerate(random):
            gen = generators[r]
            if gen is not None:  # one draw from this request's own stream
                uniforms[i] = torch.rand(1, generator=gen, device=gen.device)[0]
        chosen[rows] = draw_from(probs, uniforms)

    @staticmethod
    def skip_draws(generator: torch.Generator, num_draws: int) -> None:
        """Advance a request's generator past ``num_draws`` tokens sampled elsewhere (by a prefill
        instance, or before a migration), so its next draw is the one the request would have made.
        A draw consumes the generator the same way whatever the probabilities and the vocabulary
        (one uniform, :func:`draw_from`); tests check the continuation equals an uninterrupted run."""
        for _ in range(num_draws):
            torch.rand(1, generator=generator, device=generator.device)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,
        chosen: torch.Tensor,
        params: Sequence[SamplingParams],
        token_ids: list[int | None],
        stats: RowStats | None = None,
    ) -> list[TokenLogprobs | None]:
        wanted = [r for r, p in enumerate(params) if p.logprobs is not None and token_ids[r] is not None]
        out: list[TokenLogprobs | None] = [None] * len(params)
        if not wanted:
            return out
        rows = torch.tensor(wanted, device=logits.device)
        max_k = min(max(params[r].logprobs or 0 for r in wanted), logits.shape[1])
        top_vals_l: list[list[float]] = [[] for _ in wanted]
        top_ids_l: list[list[int]] = [[] for _ in wanted]
        if stats is not None and not max_k:  # the sampled tokens' alone: no (W, V) log_softmax
            picked = logits[rows, chosen[rows]]  # (W,)
            logp_picked = (picked - stats.top[rows]) - stats.log_sum[rows]  # log_softmax's order
            sampled = logp_picked.clamp(min=_FLOAT32_LOWEST).tolist()  # (W,)
        else:
            logp = torch.log_softmax(logits[rows], dim=-1).clamp(min=_FLOAT32_LOWEST)  # (W, V) raw, finite
            sampled = logp.gather(1, chosen[rows].unsqueeze(1)).squeeze(1).tolist()  # (W,)
            if max_k:
                top_vals, top_ids = logp.topk(max_k, dim=-1)  # (W, max_k) each, descending
                top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        for i, r in enumerate(wanted):
            k = params[r].logprobs or 0
            top = list(zip(top_ids_l[i][:k], top_vals_l[i][:k], strict=True))
            token = token_ids[r]
            assert token is not None
            out[r] = TokenLogprobs(token_id=token, logprob=sampled[i], top=top)
        return out
