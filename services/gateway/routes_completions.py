"""POST /v1/completions: text in (a string, token ids, or a list of either), text out."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from yutu.errors import ErrorKind, YutuError

from services.gateway.auth import require_api_key
from services.gateway.beam_search import Searched, check_beam_search, search
from services.gateway.chunks import completion_chunk
from services.gateway.deps import GatewayDep
from services.gateway.generation import ChoiceState, Generation, TokenInfo
from services.gateway.logprobs import completion_logprobs, echo_logprobs, joined, prompt_logprobs
from services.gateway.openapi import generation_responses
from services.gateway.prompts import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    check_cost_before_tokenizing,
    check_model,
    choice_specs,
    completion_prompts,
    max_tokens_for,
    num_prompts,
    reject_unsupported,
    truncated,
)
from services.gateway.routing import instance_headers
from services.gateway.schemas import (
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    PromptTokensDetails,
    Usage,
)
from services.gateway.service import GatewayService
from services.gateway.streaming import (
    DONE,
    ClientGone,
    EventStream,
    error_event,
    event,
    finished_stream,
    unless_disconnected,
)
from services.gateway.structured import grammar_for
from services.gateway.valid_text import require_valid_text

router = APIRouter(dependencies=[Depends(require_api_key)])


def usage_of(gen: Generation) -> Usage:
    u = gen.usage()
    return Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
    )


@router.post(
    "/v1/completions",
    response_model=None,
    responses=generation_responses(
        CompletionResponse, CompletionChunk, "a text_completion, or its chunks as SSE"
    ),
)
async def create_completion(body: CompletionRequest, request: Request, gw: GatewayDep) -> Response:
    """OpenAI's completions (vLLM's extras accepted); ``"stream": true`` answers server-sent events."""
    require_valid_text(body)
    check_model(body.model, gw.model_name)
    max_model_len = gw.require_max_model_len()
    limits = gw.settings.limits
    check_cost_before_tokenizing(body, limits, num_prompts(body), body.max_tokens, "max_tokens")
    # with truncate_prompt_tokens, a prompt too long for the context is cut, not refused
    cut = body.truncate_prompt_tokens is not None
    prompts = await completion_prompts(body, gw.prompts, None if cut else max_model_len)
    prompts = truncated(body, prompts, max_model_len)
    if body.use_beam_search:
        return await _beam_search(body, prompts, gw, request, max_model_len)
    grammar = await grammar_for(body, gw.prompts)
    specs = choice_specs(
        body,
        prompts,
        max_model_len,
        body.max_tokens,
        COMPLETIONS_DEFAULT_MAX_TOKENS,
        body.logprobs,
        limits=limits,
        tokenizer=gw.tokenizer,
        grammar=grammar,
    )
    gen = Generation(
        gw.router,
        gw.tokenizer,
        specs,
        f"cmpl-{uuid.uuid4().hex}",
        gw.gateway_metrics,
        limits.max_choices_in_flight,
    )
    await gen.place()  # a 429 or 503 is answered here, as a status, before any response starts
    echoes = echo_texts(body, prompts, gw)
    if body.stream:  # the headers go out now: they name the instances placed at the start
        headers = instance_headers(gen.first_routes)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        gen.start()  # the workers compute while the response starts (EventStream closes it)
        return EventStream(_stream(gen, gw, body, echoes, include_usage), gen.close, headers)
    try:
        async with gen:
            choices = await unless_disconnected(gen.run_to_end(), request)
    except ClientGone:
        return Response(status_code=499)
    response = CompletionResponse(
        id=gen.request_id,
        created=int(gen.arrival),
        model=gw.model_name,
        choices=[_choice(choices[i], gw, body, echoes) for i in sorted(choices)],
        usage=usage_of(gen),
    )
    return Response(
        response.model_dump_json(),
        media_type="application/json",
        headers=instance_headers(gen.current_routes()),
    )


async def _beam_search(
    body: CompletionRequest,
    prompts: list[list[int]],
    gw: GatewayService,
    request: Request,
    max_model_len: int,
) -> Response:
    """``use_beam_search``: each prompt's ``n`` best beams, whole (services/gateway/beam_search.py)."""
    reject_unsupported(body)
    check_beam_search(body)
    budgets = [
        max_tokens_for(len(ids), body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, max_model_len)
        for ids in prompts
    ]
    gw.settings.limits.check_generated(sum(budgets) * body.n, len(prompts), body.n, "max_tokens")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    searches = asyncio.gather(
        *(
            search(gw, body, ids, budget, f"{request_id}-{p}")
            for p, (ids, budget) in enumerate(zip(prompts, budgets, strict=True))
        )
    )
    try:
        results = await unless_disconnected(searches, request)
    except ClientGone:
        return Response(status_code=499)
    echoes = echo_texts(body, prompts, gw)
    choices = [
        CompletionResponseChoice(
            index=p * body.n + j,
            text=(echoes[p] if echoes else "") + gw.tokenizer.decode(beam.tokens, body.skip_special_tokens),
            finish_reason=beam.finish_reason,
            prompt_token_ids=prompts[p] if body.return_token_ids else None,
            token_ids=list(beam.tokens) if body.return_token_ids else None,
        )
        for p, result in enumerate(results)
        for j, beam in enumerate(result.beams)
    ]
    usage = beam_usage(prompts, results)
    response = CompletionResponse(
        id=request_id, created=created, model=gw.model_name, choices=choices, usage=usage
    )
    if body.stream:
        return _beam_stream(body, response, usage)
    return Response(response.model_dump_json(), media_type="application/json")


def _beam_stream(body: CompletionRequest, response: CompletionResponse, usage: Usage) -> Response:
    """A beam search's ``response`` streamed as vLLM's server streams it (services/gateway/beam_search.py):
    each choice in one chunk, its text and finish reason; the usage if asked; [DONE]."""
    options = body.stream_options
    continuous = usage.model_dump() if options is not None and options.continuous_usage_stats else None
    events = [completion_chunk(response.id, response.created, response.model, c.index, c.text, None,
                               c.finish_reason, None, continuous, c.prompt_token_ids, c.token_ids)
              for c in response.choices]  # fmt: skip
    if options is not None and options.include_usage:
        tail = CompletionChunk(
            id=response.id, created=response.created, model=response.model, choices=[], usage=usage
        )
        events.append(event(tail))
    return finished_stream(events)


def beam_usage(prompts: list[list[int]], results: list[Searched]) -> Usage:
    """A beam search's usage: its prompts once each, the tokens of the beams returned."""
    prompt = sum(len(ids) for ids in prompts)
    completion = sum(len(beam.tokens) for result in results for beam in result.beams)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in results)),
    )


def echo_texts(body: CompletionRequest, prompts: list[list[int]], gw: GatewayService) -> list[str] | None:
    """With ``echo``, each prompt's text as the response repeats it: as sent, or decoded from the
    token ids sent or kept (``truncate_prompt_tokens``); None without."""
    if not body.echo:
        return None
    if body.truncate_prompt_tokens is not None:
        return [gw.tokenizer.decode(ids) for ids in prompts]
    if isinstance(body.prompt, str):
        return [body.prompt]
    if all(isinstance(p, str) for p in body.prompt):
        return [str(p) for p in body.prompt]
    return [gw.tokenizer.decode(ids) for ids in prompts]


def _logprobs(
    tokens: list[TokenInfo], state: ChoiceState, gw: GatewayService, body: CompletionRequest, echo: str | None,
    with_prompt: bool,
) -> dict[str, list[Any]]:  # fmt: skip
    """Completions-style logprobs of ``tokens``; with ``echo``, their offsets after the echoed text,
    and (``with_prompt``) the prompt's tokens first."""
    as_ids = body.return_tokens_as_token_ids
    generated = completion_logprobs(tokens, gw.token_text, as_ids)
    if echo is None:
        return generated
    prompt: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if with_prompt:
        if state.prompt_logprobs is None:
            raise YutuError(
                "the worker sent no prompt logprobs for an echo with logprobs", ErrorKind.INTERNAL
            )
        assert body.logprobs is not None, "echo scores the prompt only with logprobs"
        prompt = echo_logprobs(
            state.spec.prompt_ids, state.prompt_logprobs, gw.tokenizer, gw.token_text, body.logprobs, as_ids
        )
    return joined(prompt, generated, len(echo))


def _choice(
    state: ChoiceState, gw: GatewayService, body: CompletionRequest, echoes: list[str] | None
) -> CompletionResponseChoice:
    echo = None if echoes is None else echoes[state.spec.prompt_index]
    logprobs = None
    if body.logprobs is not None:
        logprobs = CompletionLogprobs.model_validate(_logprobs(state.tokens, state, gw, body, echo, True))
    return CompletionResponseChoice(
        index=state.spec.index,
        text=(echo or "") + state.text,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs_of(state, gw, body.prompt_logprobs),
        finish_reason=state.finish_reason,
        stop_reason=state.stop_reason,
        prompt_token_ids=state.spec.prompt_ids if body.return_token_ids else None,
        token_ids=token_ids(state.tokens) if body.return_token_ids else None,
    )


def token_ids(tokens: list[TokenInfo]) -> list[int]:
    return [tok.token_id for tok in tokens]


def prompt_logprobs_of(state: ChoiceState, gw: GatewayService, k: int | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` of ``state``'s prompt, with ``k`` alternatives (None: not asked)."""
    if k is None:
        return None
    if state.prompt_logprobs is None:
        raise YutuError("the worker sent no prompt logprobs for prompt_logprobs", ErrorKind.INTERNAL)
    return prompt_logprobs(state.spec.prompt_ids, state.prompt_logprobs, gw.token_text, k)


async def _stream(
    gen: Generation,
    gw: GatewayService,
    body: CompletionRequest,
    echoes: list[str] | None,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(gen.arrival)
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
    tail = ""
    started: set[int] = set()  # choices whose first chunk (with the echoed prompt, its ids) went out
    ids = body.return_token_ids
    try:
        async with gen:
            async for update in gen.updates():
                state = gen.choices[update.index]
                echo = None if echoes is None else echoes[state.spec.prompt_index]
                first = update.index not in started
                shown = update.text or update.finish_reason or body.logprobs is not None or ids
                if not (shown or (first and echo is not None)):
                    continue  # tokens whose text is still held back (half a character, a stop prefix)
                started.add(update.index)
                logprobs = None
                if body.logprobs is not None:
                    logprobs = _logprobs(update.tokens, state, gw, body, echo, first)
                text = (echo or "") + update.text if first else update.text
                yield completion_chunk(
                    gen.request_id, created, gw.model_name, update.index, text, logprobs,
                    update.finish_reason, update.stop_reason, usage_of(gen).model_dump() if continuous else None,
                    state.spec.prompt_ids if ids and first else None, token_ids(update.tokens) if ids else None,
                )  # fmt: skip
            if include_usage:
                tail = event(
                    CompletionChunk(
                        id=gen.request_id,
                        created=created,
                        model=gw.model_name,
                        choices=[],
                        usage=usage_of(gen),
                    )
                )
    except YutuError as exc:
        tail = error_event(exc)
    yield tail + DONE  # with the usage or the error: one socket write
