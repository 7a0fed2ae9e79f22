"""POST /v1/chat/completions: messages rendered with the model's chat template, streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from yutu.errors import YutuError

from services.gateway.auth import require_api_key
from services.gateway.beam_search import Searched, check_beam_search, search
from services.gateway.chunks import chat_choice, chat_chunk
from services.gateway.deps import GatewayDep
from services.gateway.errors import invalid
from services.gateway.generation import ChoiceState, Generation
from services.gateway.logprobs import chat_logprobs
from services.gateway.openapi import generation_responses
from services.gateway.prompts import (
    chat_echo,
    chat_prompt,
    check_cost_before_tokenizing,
    check_model,
    choice_specs,
    max_tokens_for,
    reject_unsupported,
    request_chat_template,
    truncated,
)
from services.gateway.reasoning import ReasoningSplit, Thinking, skip_special_tokens_for, thinking_of
from services.gateway.routes_completions import beam_usage, prompt_logprobs_of, token_ids, usage_of
from services.gateway.routing import instance_headers
from services.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
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
from services.gateway.tool_parsers import parser_named
from services.gateway.tools import ChoiceStream, ToolPlan, tool_plan
from services.gateway.valid_text import require_valid_text

router = APIRouter(dependencies=[Depends(require_api_key)])


def _max_tokens(body: ChatCompletionRequest) -> int | None:
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        if body.max_tokens != body.max_completion_tokens:
            raise invalid("give max_completion_tokens or max_tokens, not both", "max_tokens")
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses=generation_responses(
        ChatCompletionResponse, ChatCompletionChunk, "a chat.completion, or its chunks as SSE"
    ),
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, gw: GatewayDep) -> Response:
    """OpenAI's chat completions, rendered with the model's chat template; ``"stream": true``: SSE."""
    require_valid_text(body)
    check_model(body.model, gw.model_name)
    max_model_len = gw.require_max_model_len()
    requested = _max_tokens(body)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    limits = gw.settings.limits
    check_cost_before_tokenizing(body, limits, 1, requested, param)
    plan = tool_plan(body, parser_named(gw.settings.tool_call_parser))
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    # with truncate_prompt_tokens, a prompt too long for the context is cut, not refused
    cut = body.truncate_prompt_tokens is not None
    prompt = await chat_prompt(
        body.messages, gw.prompts, body.add_generation_prompt, None if cut else max_model_len, tools,
        body.continue_final_message, body.chat_template_kwargs, body.documents, body.add_special_tokens,
        request_chat_template(body.chat_template, gw.settings.trust_request_chat_template),
    )  # fmt: skip
    (prompt,) = truncated(body, [prompt], max_model_len)
    if body.use_beam_search:
        return await _beam_search(body, prompt, gw, request, max_model_len, requested, param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # No default cap: a chat completion may run to the end of the context, as with OpenAI.
    grammar = await grammar_for(body, gw.prompts, plan.schema)
    thinking = thinking_of(gw.settings.reasoning_parser, gw.tokenizer, prompt, constrained=grammar is not None,
                           shown=body.include_reasoning)  # fmt: skip
    specs = choice_specs(
        body, [prompt], max_model_len, requested, None, logprobs,
        limits=limits, tokenizer=gw.tokenizer,
        max_tokens_param=param, prompt_param="messages", grammar=grammar,
        grammar_after_thinking=None if thinking is None else thinking.grammar_after,
        skip_special_tokens=skip_special_tokens_for(thinking, plan.skip_special_tokens(body.skip_special_tokens)),
    )  # fmt: skip
    gen = Generation(
        gw.router,
        gw.tokenizer,
        specs,
        f"chatcmpl-{uuid.uuid4().hex}",
        gw.gateway_metrics,
        limits.max_choices_in_flight,
    )
    await gen.place()  # a 429 or 503 is answered here, as a status, before any response starts
    if body.stream:  # the headers go out now: they name the instances placed at the start
        headers = instance_headers(gen.first_routes)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        gen.start()  # the workers compute while the response starts (EventStream closes it)
        return EventStream(_stream(gen, gw, body, plan, thinking, include_usage), gen.close, headers)
    try:
        async with gen:
            choices = await unless_disconnected(gen.run_to_end(), request)
    except ClientGone:
        return Response(status_code=499)
    response = ChatCompletionResponse(
        id=gen.request_id,
        created=int(gen.arrival),
        model=gw.model_name,
        choices=[_choice(choices[i], gw, body, plan, thinking) for i in sorted(choices)],
        usage=usage_of(gen),
        # the choices share their prompt: its logprobs and ids are the response's
        prompt_logprobs=prompt_logprobs_of(choices[min(choices)], gw, body.prompt_logprobs),
        prompt_token_ids=prompt if body.return_token_ids else None,
    )
    return Response(
        response.model_dump_json(),
        media_type="application/json",
        headers=instance_headers(gen.current_routes()),
    )


async def _beam_search(
    body: ChatCompletionRequest, prompt: list[int], gw: GatewayService, request: Request, max_model_len: int,
    requested: int | None, param: str,
) -> Response:  # fmt: skip
    """``use_beam_search``: the ``n`` best beams, whole (services/gateway/beam_search.py)."""
    reject_unsupported(body)
    check_beam_search(body)
    budget = max_tokens_for(len(prompt), requested, None, max_model_len, "messages", param)
    gw.settings.limits.check_generated(budget * body.n, 1, body.n, param)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    try:
        result = await unless_disconnected(search(gw, body, prompt, budget, request_id), request)
    except ClientGone:
        return Response(status_code=499)
    echo = chat_echo(body)
    thinking = thinking_of(
        gw.settings.reasoning_parser, gw.tokenizer, prompt, constrained=False, shown=body.include_reasoning
    )
    skip = skip_special_tokens_for(thinking, body.skip_special_tokens)
    texts = [gw.tokenizer.decode(beam.tokens, skip) for beam in result.beams]
    choices = []
    for j, (beam, text) in enumerate(zip(result.beams, texts, strict=True)):
        reasoning, content = _split(thinking, text)
        shown = _shown(thinking, reasoning)
        choices.append(ChatChoice(
            index=j,
            message=AssistantMessage(content=_content(echo, content, reasoning), reasoning=shown,
                                     reasoning_content=shown),
            finish_reason=beam.finish_reason,
            token_ids=list(beam.tokens) if body.return_token_ids else None,
        ))  # fmt: skip
    usage = beam_usage([prompt], [result])
    response = ChatCompletionResponse(
        id=request_id, created=created, model=gw.model_name, choices=choices, usage=usage,
        prompt_token_ids=prompt if body.return_token_ids else None,
    )  # fmt: skip
    if body.stream:
        return _beam_stream(body, response, usage, result, texts, thinking)
    return Response(response.model_dump_json(), media_type="application/json")


def _beam_stream(
    body: ChatCompletionRequest, response: ChatCompletionResponse, usage: Usage, result: Searched,
    texts: list[str], thinking: Thinking | None,
) -> Response:  # fmt: skip
    """A beam search's ``response`` streamed as vLLM's server streams it (services/gateway/beam_search.py):
    each choice's role, then its whole output through the deltas a streamed choice makes (the
    reasoning first, with a parser), its finish; the usage if asked; [DONE]."""
    options = body.stream_options
    continuous = usage.model_dump() if options is not None and options.continuous_usage_stats else None
    ids = body.return_token_ids

    def chunk(choice: dict[str, Any], prompt_token_ids: list[int] | None = None) -> str:
        return chat_chunk(
            response.id, response.created, response.model, [choice], continuous, prompt_token_ids
        )

    indices = range(len(result.beams))
    events = list(_openings(chunk, indices, "", response.prompt_token_ids, chat_echo(body)))
    for index, beam, text in zip(indices, result.beams, texts, strict=True):
        stream = ChoiceStream(
            index, ToolPlan("none"), ids, None if thinking is None else ReasoningSplit(thinking)
        )
        deltas, finish_reason = stream.feed(text, None, beam.finish_reason, beam.tokens)
        events += map(chunk, deltas)
        events.append(chunk(chat_choice(index, finish_reason=finish_reason)))
    if options is not None and options.include_usage:
        events.append(
            event(ChatCompletionChunk(id=response.id, created=response.created, model=response.model, choices=[],
                                      usage=usage))
        )  # fmt: skip
    return finished_stream(events)


def _openings(
    chunk: Callable[..., str],
    indices: Iterable[int],
    opening: str | None,
    prompt_ids: list[int] | None,
    echo: str,
) -> Iterator[str]:
    """What a streamed response starts with: each choice's role (with ``opening`` as content: "",
    or None where the output is tool calls; vLLM's ``prompt_ids`` on each role chunk), as OpenAI
    sends it, then with ``echo`` each choice's echoed content (vLLM's), before any generated."""
    yield "".join(
        chunk(chat_choice(index, role="assistant", content=opening), prompt_ids) for index in indices
    )
    if echo:
        yield "".join(chunk(chat_choice(index, content=echo)) for index in indices)


def _split(thinking: Thinking | None, text: str) -> tuple[str | None, str]:
    """A choice's text as its reasoning (None: no thinking, or no parser) and its answer."""
    return (None, text) if thinking is None else thinking.split(text)


def _shown(thinking: Thinking | None, reasoning: str | None) -> str | None:
    """The reasoning the response carries: none where the request asked for none (include_reasoning)."""
    return reasoning if thinking is not None and thinking.shown else None


def _content(echo: str, content: str | None, reasoning: str | None) -> str | None:
    """The message's content: None where the model only thought; the echo first, as vLLM does
    (tool calls or not)."""
    if reasoning is not None and not content:
        content = None
    return echo + (content or "") if echo else content


def _choice(
    state: ChoiceState, gw: GatewayService, body: ChatCompletionRequest, plan: ToolPlan,
    thinking: Thinking | None,
) -> ChatChoice:  # fmt: skip
    lp = None
    if body.logprobs:
        lp = ChatChoiceLogprobs.model_validate(
            {"content": chat_logprobs(state.tokens, gw.token_text, body.return_tokens_as_token_ids)}
        )
    reasoning, text = _split(thinking, state.text)
    content, calls = plan.message(text)
    content = _content(chat_echo(body), content, reasoning)
    shown = _shown(thinking, reasoning)
    return ChatChoice(
        index=state.spec.index,
        message=AssistantMessage(content=content, tool_calls=calls, reasoning=shown, reasoning_content=shown),
        logprobs=lp,
        finish_reason=plan.finish_reason(state.finish_reason, calls),
        stop_reason=state.stop_reason,
        token_ids=token_ids(state.tokens) if body.return_token_ids else None,
    )


async def _stream(
    gen: Generation, gw: GatewayService, body: ChatCompletionRequest, plan: ToolPlan,
    thinking: Thinking | None, include_usage: bool,
) -> AsyncIterator[str]:  # fmt: skip
    """The chunks: each choice's deltas as its tools shape them (services.gateway.tools.ChoiceStream)."""
    created = int(gen.arrival)
    logprobs, as_ids = body.logprobs, body.return_tokens_as_token_ids

    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats

    def chunk(choice: dict[str, Any], prompt_token_ids: list[int] | None = None) -> str:
        usage = usage_of(gen).model_dump() if continuous else None
        return chat_chunk(gen.request_id, created, gw.model_name, [choice], usage, prompt_token_ids)

    ids = body.return_token_ids
    streams = {
        index: ChoiceStream(index, plan, ids, None if thinking is None else ReasoningSplit(thinking))
        for index in gen.choices
    }

    # Events that go out together are yielded as one string: one socket write each time.
    tail = ""
    try:
        async with gen:
            # The choices share one prompt (vLLM's return_token_ids: its ids on each role chunk).
            prompt_ids = gen.choices[min(gen.choices)].spec.prompt_ids if ids else None
            opening = None if plan.calls else ""
            for opened in _openings(chunk, sorted(gen.choices), opening, prompt_ids, chat_echo(body)):
                yield opened
            async for update in gen.updates():
                lp = chat_logprobs(update.tokens, gw.token_text, as_ids) if logprobs else None
                deltas, finish_reason = streams[update.index].feed(
                    update.text, lp, update.finish_reason, token_ids(update.tokens)
                )
                out = "".join(map(chunk, deltas))
                if finish_reason is not None:
                    out += chunk(
                        chat_choice(update.index, finish_reason=finish_reason, stop_reason=update.stop_reason)
                    )
                if out:
                    yield out
            if include_usage:
                usage = ChatCompletionChunk(
                    id=gen.request_id, created=created, model=gw.model_name, choices=[], usage=usage_of(gen)
                )
                tail = event(usage)
    except YutuError as exc:
        tail = error_event(exc)
    yield tail + DONE
