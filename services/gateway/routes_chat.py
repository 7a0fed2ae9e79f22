"""POST /v1/chat/completions: messages rendered with the model's chat template, streamed or not."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from yutu.errors import YutuError

from services.gateway.auth import require_api_key
from services.gateway.chunks import chat_choice, chat_chunk
from services.gateway.deps import GatewayDep
from services.gateway.errors import invalid
from services.gateway.generation import ChoiceState, ChoiceUpdate, Generation
from services.gateway.logprobs import chat_logprobs
from services.gateway.openapi import generation_responses
from services.gateway.prompts import chat_prompt, check_cost_before_tokenizing, check_model, choice_specs
from services.gateway.routes_completions import usage_of
from services.gateway.routing import instance_headers
from services.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from services.gateway.service import GatewayService
from services.gateway.streaming import DONE, ClientGone, EventStream, error_event, event, unless_disconnected
from services.gateway.tools import ToolPlan, new_call, tool_plan
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
    plan = tool_plan(body)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    prompt = await chat_prompt(body.messages, gw.prompts, body.add_generation_prompt, max_model_len, tools)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # No default cap: a chat completion may run to the end of the context, as with OpenAI.
    specs = choice_specs(
        body, [prompt], max_model_len, requested, None, logprobs,
        limits=limits, vocab_size=gw.tokenizer.vocab_size,
        max_tokens_param=param, prompt_param="messages", tool_schema=plan.schema,
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
        return EventStream(_stream(gen, gw, body, plan, include_usage), gen.close, headers)
    try:
        async with gen:
            choices = await unless_disconnected(gen.run_to_end(), request)
    except ClientGone:
        return Response(status_code=499)
    response = ChatCompletionResponse(
        id=gen.request_id,
        created=int(gen.arrival),
        model=gw.model_name,
        choices=[_choice(choices[i], gw, body, plan) for i in sorted(choices)],
        usage=usage_of(gen),
    )
    return Response(
        response.model_dump_json(),
        media_type="application/json",
        headers=instance_headers(gen.current_routes()),
    )


def _choice(
    state: ChoiceState, gw: GatewayService, body: ChatCompletionRequest, plan: ToolPlan
) -> ChatChoice:
    lp = None
    if body.logprobs:
        lp = ChatChoiceLogprobs.model_validate(
            {"content": chat_logprobs(state.tokens, gw.token_text, body.return_tokens_as_token_ids)}
        )
    calls = plan.tool_calls(state.text)
    return ChatChoice(
        index=state.spec.index,
        message=AssistantMessage(content=None if calls else state.text, tool_calls=calls),
        logprobs=lp,
        finish_reason=plan.finish_reason(state.finish_reason, calls),
        stop_reason=state.stop_reason,
    )


async def _stream(
    gen: Generation, gw: GatewayService, body: ChatCompletionRequest, plan: ToolPlan, include_usage: bool
) -> AsyncIterator[str]:
    """The chunks: text as it comes; a named tool call's arguments as they come (its id and name
    with the first); ``required`` tool calls whole at the end (a partial array is no call yet)."""
    created = int(gen.arrival)
    logprobs, as_ids = body.logprobs, body.return_tokens_as_token_ids

    def chunk(choice: dict[str, Any]) -> str:
        return chat_chunk(gen.request_id, created, gw.model_name, [choice])

    def lp_of(update: ChoiceUpdate) -> list[dict[str, Any]] | None:
        return chat_logprobs(update.tokens, gw.token_text, as_ids) if logprobs else None

    named: set[int] = set()  # choices whose named call has gone out (its id and name)
    held: dict[int, tuple[list[str], list[dict[str, Any]]]] = {}  # required: text and logprobs so far

    def output(update: ChoiceUpdate) -> tuple[str, str | None]:
        """The update's chunk of output (maybe none), and the finish reason to send with it."""
        has_news = bool(update.text or (logprobs and update.tokens))
        if plan.mode == "named":
            if not has_news and (update.finish_reason is None or update.index in named):
                return "", update.finish_reason
            first = update.index not in named
            named.add(update.index)
            call: dict[str, Any] = {"index": 0, "function": {"arguments": update.text}}
            if first:
                assert plan.function is not None
                call = {"index": 0, "id": new_call(plan.function, "").id, "type": "function",
                        "function": {"name": plan.function, "arguments": update.text}}  # fmt: skip
            return chunk(
                chat_choice(update.index, tool_calls=[call], logprobs=lp_of(update))
            ), update.finish_reason
        if plan.mode == "required":
            texts, lps = held.setdefault(update.index, ([], []))
            texts.append(update.text)
            lps += lp_of(update) or []
            if update.finish_reason is None:
                return "", None
            text = "".join(texts)
            calls = plan.tool_calls(text)
            lp = lps if logprobs else None
            if calls is None:
                return chunk(chat_choice(update.index, content=text, logprobs=lp)), update.finish_reason
            deltas = [{"index": i, "id": c.id, "type": "function", "function": c.function.model_dump()}
                      for i, c in enumerate(calls)]  # fmt: skip
            reason = plan.finish_reason(update.finish_reason, calls)
            return chunk(chat_choice(update.index, tool_calls=deltas, logprobs=lp)), reason
        if not has_news:
            return "", update.finish_reason
        return chunk(
            chat_choice(update.index, content=update.text, logprobs=lp_of(update))
        ), update.finish_reason

    # Events that go out together are yielded as one string: one socket write each time.
    tail = ""
    try:
        async with gen:
            # The role comes first, once per choice, as OpenAI sends it (with "" as content, unless
            # the output is tool calls).
            opening = None if plan.calls else ""
            yield "".join(
                chunk(chat_choice(index, role="assistant", content=opening)) for index in sorted(gen.choices)
            )
            async for update in gen.updates():
                out, finish_reason = output(update)
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
