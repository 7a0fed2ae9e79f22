"""Turn logits into tokens: greedy, temperature, top-k, top-p, per-request seeds, and logprobs.

All maths runs in float32 on the logits' device. Reproducibility: a request with ``params.seed`` owns
a ``torch.Generator`` and its row is sampled alone from it, one draw per generated token, so its
tokens do not depend on what else is in the batch. Requests without a seed share torch's default RNG.
Logprobs are ``log_softmax`` of the raw logits (before temperature/top-k/top-p), like OpenAI and vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from yutu.engine.outputs import TokenLogprobs
from yutu.engine.sampling import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # (R,) one sampled token per logits row
    logprobs: list[TokenLogprobs | None]  # (R,) None where params.logprobs is None


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p sets; returns a new tensor.

    logits: (R, V) float32; top_k: (R,) int64 in [1, V] (V disables); top_p: (R,) float32 in (0, 1]
    where 1 disables. The most likely token is never masked.
    """
    num_rows, vocab = logits.shape
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # (R, V) each
    ranks = torch.arange(vocab, device=logits.device).expand(num_rows, vocab)  # (R, V)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # (R, V)
    mass_before = probs.cumsum(dim=-1) - probs  # (R, V) probability of strictly more likely tokens
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


class Sampler:
    """Stateless apart from torch's default RNG; per-request generators are passed in."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` (R, V) with ``params[r]`` and ``generators[r]``."""
        num_rows, vocab = logits.shape
        assert len(params) == num_rows == len(generators)
        logits = logits.float()
        chosen = torch.empty(num_rows, dtype=torch.long, device=logits.device)  # (R,)

        greedy = [r for r, p in enumerate(params) if p.is_greedy]
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            chosen[rows] = logits[rows].argmax(dim=-1)

        random = [r for r, p in enumerate(params) if not p.is_greedy]
        if random:
            rows = torch.tensor(random, device=logits.device)
            temps = torch.tensor([params[r].temperature for r in random], device=logits.device)
            top_k = torch.tensor([params[r].top_k or vocab for r in random], device=logits.device)
            top_p = torch.tensor([params[r].top_p for r in random], device=logits.device)
            scaled = logits[rows] / temps.unsqueeze(1)  # (Rr, V)
            probs = apply_top_k_top_p(scaled, top_k.clamp(max=vocab), top_p).softmax(dim=-1)  # (Rr, V)
            unseeded = [i for i, r in enumerate(random) if generators[r] is None]
            if unseeded:
                idx = torch.tensor(unseeded, device=logits.device)
                chosen[rows[idx]] = torch.multinomial(probs[idx], 1).squeeze(1)
            for i, r in enumerate(random):
                gen = generators[r]
                if gen is not None:  # one draw from this request's own stream
                    chosen[r] = torch.multinomial(probs[i], 1, generator=gen)[0]

        token_ids: list[int] = chosen.tolist()
        return SamplerOutput(token_ids, self._logprobs(logits, chosen, params))

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, chosen: torch.Tensor, params: Sequence[SamplingParams]
    ) -> list[TokenLogprobs | None]:
        wanted = [r for r, p in enumerate(params) if p.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(params)
        if not wanted:
            return out
        rows = torch.tensor(wanted, device=logits.device)
        logp = torch.log_softmax(logits[rows], dim=-1)  # (W, V) float32, raw distribution
        sampled = logp.gather(1, chosen[rows].unsqueeze(1)).squeeze(1).tolist()  # (W,)
        max_k = min(max(params[r].logprobs or 0 for r in wanted), logp.shape[1])
        top_vals_l: list[list[float]] = [[] for _ in wanted]
        top_ids_l: list[list[int]] = [[] for _ in wanted]
        if max_k:
            top_vals, top_ids = logp.topk(max_k, dim=-1)  # (W, max_k) each, descending
            top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        chosen_l = chosen.tolist()
        for i, r in enumerate(wanted):
            k = params[r].logprobs or 0
            top = list(zip(top_ids_l[i][:k], top_vals_l[i][:k], strict=True))
            out[r] = TokenLogprobs(token_id=chosen_l[r], logprob=sampled[i], top=top)
        return out
