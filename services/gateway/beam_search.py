"""Beam search (vLLM's ``use_beam_search``), run by the gateway as vLLM's server runs it.

Each round asks the workers for one token of every live beam -- an ordinary request of the beam's
whole sequence, ``max_tokens`` 1, with its ``2 x width`` most likely next tokens (their logprobs are
the model's raw ones) -- and keeps the ``width`` best extensions by their score,
``cumulative logprob / length ** length_penalty`` (the length of the whole sequence, prompt
included, without an eos that ends it: vLLM's ``get_beam_search_score``). An extension by an eos
token (unless ``ignore_eos``) is a finished beam; after ``max_tokens`` rounds the live beams join
the finished ones and the ``width`` best are the choices. A round's sequences share all but their
last tokens with the round before, so the prefix cache computes little more than those.

The width is the request's ``n`` (at most 10: twice that many alternatives per token is the API's
limit of 20). What it does not use (sampling, penalties, stop conditions, logprobs, structured
outputs, tools) is refused, not ignored. Streamed, it is what vLLM's server sends: the beams are
known only when the search ends, so then each choice's text comes in one piece, with its finish.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from yutu.engine.sampling import MAX_LOGPROBS, SamplingParams

from services.gateway.errors import invalid
from services.gateway.generation import Generation
from services.gateway.prompts import ChoiceSpec
from services.gateway.schemas import _GenerationRequest
from services.gateway.service import GatewayService

MAX_WIDTH = MAX_LOGPROBS // 2
# What a beam search request may set beyond its defaults: what shapes the prompt, and the search.
_APPLIES = frozenset(
    {
        "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "use_beam_search",
        "length_penalty", "ignore_eos", "echo", "user", "skip_special_tokens", "truncate_prompt_tokens",
        "cache_salt", "priority", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
        "documents", "add_special_tokens", "chat_template", "return_token_ids", "stream", "stream_options",
    }
)  # fmt: skip
_ids = itertools.count()


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]  # generated
    cum_logprob: float
    finished: bool = False  # ended by an eos token

    @property
    def finish_reason(self) -> str:
        return "stop" if self.finished else "length"


@dataclass(frozen=True)
class Searched:
    beams: list[Beam]  # the best, best first
    cached_tokens: int  # of the prompt, found in a prefix cache by the first round


def score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: the cumulative logprob over the whole sequence's length
    (prompt included, an ending eos not) to the power ``length_penalty``."""
    length = prompt_len + len(beam.tokens) - (1 if beam.finished else 0)
    return beam.cum_logprob / (length**length_penalty)


def check_beam_search(req: _GenerationRequest) -> None:
    """400s for a beam search request that sets what beam search does not use, or a bad width."""
    if not req.use_beam_search:
        return
    if not 1 <= req.n <= MAX_WIDTH:
        raise invalid(f"n is the beam width with use_beam_search: 1 to {MAX_WIDTH}", "n")
    if req.temperature not in (None, 0):
        raise invalid(
            "beam search ranks by the model's logprobs: leave temperature unset (or 0)", "temperature"
        )
    defaults = type(req).model_fields
    for name in sorted(req.model_fields_set - _APPLIES - {"temperature"}):
        if getattr(req, name) != defaults[name].get_default(call_default_factory=True):
            raise invalid(f"{name} does not apply to beam search: leave it unset", name)


async def search(
    gw: GatewayService, req: _GenerationRequest, prompt: list[int], max_tokens: int, request_id: str
) -> Searched:
    """The ``req.n`` best beams of ``prompt``, best first, after up to ``max_tokens`` rounds."""
    width = req.n
    length_penalty = 1.0 if req.length_penalty is None else float(req.length_penalty)
    eos = frozenset(gw.tokenizer.eos_token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2 * width)

    def best_first(beams: list[Beam]) -> list[Beam]:
        return sorted(beams, key=lambda b: score(b, len(prompt), length_penalty), reverse=True)

    live, finished = [Beam((), 0.0)], []
    cached = 0
    for round_ in range(max_tokens):
        specs = [
            ChoiceSpec(
                i, 0, prompt + list(beam.tokens), params, (), cache_salt=req.cache_salt, priority=req.priority
            )
            for i, beam in enumerate(live)
        ]
        gen = Generation(
            gw.router, gw.tokenizer, specs, f"{request_id}-b{next(_ids)}", gw.gateway_metrics,
            gw.settings.limits.max_choices_in_flight,
        )  # fmt: skip
        async with gen:
            states = await gen.run_to_end()
        if round_ == 0:
            cached = states[0].num_cached_tokens
        grown = []
        for i, beam in enumerate(live):
            (token,) = states[i].tokens
            for alt, logprob in token.top:
                ends = alt in eos and not req.ignore_eos
                grown.append(Beam(beam.tokens + (alt,), beam.cum_logprob + logprob, ends))
        finished += [b for b in grown if b.finished]
        live = best_first([b for b in grown if not b.finished])[:width]
        if not live:
            break
    return Searched(best_first(finished + live)[:width], cached)
