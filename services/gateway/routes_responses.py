"""POST /v1/responses: OpenAI's Responses API over the chat completion it means
(services/gateway/responses_api.py); GET /v1/responses/{id}: no response is stored (404)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from services.gateway.auth import require_api_key
from services.gateway.deps import GatewayDep
from services.gateway.errors import ApiError
from services.gateway.openapi import api_responses
from services.gateway.responses_api import (
    ResponseEvents,
    ResponsesRequest,
    Shell,
    chat_request,
    renamed,
    response_object,
)
from services.gateway.routes_chat import create_chat_completion
from services.gateway.routing import routed_headers
from services.gateway.streaming import EventStream

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/responses", response_model=None, responses=api_responses(413, 429))
async def create_response(body: ResponsesRequest, request: Request, gw: GatewayDep) -> Response:
    """A model response to ``input`` (text and function calls in, text and function calls out);
    ``"stream": true``: typed server-sent events."""
    chat = chat_request(body)
    shell = Shell(body, gw.model_name)
    try:
        answer = await create_chat_completion(chat.request, request, gw)
    except ApiError as err:
        raise renamed(err, chat.origins) from None

    def count_tokens(text: str) -> int:  # the reasoning's, encoded again (the chat answer has text)
        return len(gw.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    if isinstance(answer, EventStream):
        events = ResponseEvents(shell, count_tokens)
        return answer.relay(lambda chat_events: _responses_events(events, chat_events))
    if answer.status_code != 200:  # 499: the client left
        return answer
    made = response_object(shell, json.loads(bytes(answer.body)), count_tokens)
    return JSONResponse(made, headers=routed_headers(answer.headers))


async def _responses_events(
    events: ResponseEvents, chat_events: AsyncIterable[str | bytes]
) -> AsyncIterator[str]:
    try:
        yield events.start()
        async for data in chat_events:
            out = events.feed(data.decode() if isinstance(data, bytes) else data)
            if out:
                yield out
    finally:  # the chat events' generator ends with this one (a client gone mid-stream included)
        close = getattr(chat_events, "aclose", None)
        if close is not None:
            await close()


@router.get("/v1/responses/{response_id}", response_model=None, responses=api_responses(404))
async def get_response(response_id: str) -> Response:
    """Responses are not stored here (every one says ``"store": false``): always 404."""
    raise ApiError(
        f"no response {response_id!r}: this gateway stores no responses (store is not supported)",
        404,
        "not_found_error",
        "response_id",
    )
