"""OpenAI's Responses API: ``POST /v1/responses``, over the chat completion it means
(services/gateway/responses_api.py), the stored responses (services/gateway/response_store.py):
``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, and background
responses (services/gateway/background.py): ``POST /v1/responses/{id}/cancel``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from services.gateway.auth import require_api_key
from services.gateway.deps import GatewayDep
from services.gateway.errors import ApiError, invalid
from services.gateway.openapi import api_responses
from services.gateway.response_store import ResponseStore, StoredResponse, owner_of
from services.gateway.responses_api import (
    LOGPROBS,
    ResponseEvents,
    ResponsesRequest,
    Shell,
    chat_request,
    input_items,
    renamed,
    response_object,
)
from services.gateway.routes_chat import create_chat_completion
from services.gateway.routing import routed_headers
from services.gateway.streaming import EventStream

router = APIRouter(dependencies=[Depends(require_api_key)])

Keep = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@router.post("/v1/responses", response_model=None, responses=api_responses(413, 429, 503))
async def create_response(body: ResponsesRequest, request: Request, gw: GatewayDep) -> Response:
    """A model response to ``input`` (text and function calls in, text and function calls out),
    continuing ``previous_response_id``'s conversation when given; ``"stream": true``: typed
    server-sent events. Kept for ``GET /v1/responses/{id}`` unless ``"store": false``."""
    store = gw.responses
    owner = _owner(gw, request)
    if body.background:
        _check_background(body, store)
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        earlier = (await _previous(gw, body.previous_response_id, owner)).context()
    # a background response is made from the chat completion's stream, read by the gateway itself
    chat = chat_request(body.model_copy(update={"stream": True}) if body.background else body, earlier)
    if body.logprobs and gw.settings.reasoning_parser:
        raise invalid(
            "logprobs are served on /v1/responses for answers that are all text, and this gateway splits a"
            " reasoning model's thinking off its answer (--reasoning-parser): use /v1/chat/completions,"
            " whose logprobs cover the thinking too",
            "include" if LOGPROBS in (body.include or []) else "top_logprobs",
        )
    keep = store is not None and body.store is not False
    shell = Shell(body, gw.model_name, store=keep)
    items = [*earlier, *input_items(body)] if keep else []

    async def kept(response: dict[str, Any]) -> dict[str, Any]:
        """``response``, kept (``store`` false in it if it could not be: Redis is away)."""
        if not keep:
            return response
        assert store is not None
        try:
            await store.save(StoredResponse(response, items, owner))
        except ApiError:  # logged by the store; the answer is made, and says it was not kept
            return {**response, "store": False}
        return response

    try:
        answer = await create_chat_completion(chat.request, request, gw)
    except ApiError as err:
        raise renamed(err, chat.origins) from None

    def count_tokens(text: str) -> int:  # the reasoning's, encoded again (the chat answer has text)
        return len(gw.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    if body.background:
        assert isinstance(answer, EventStream) and gw.background is not None
        queued = await gw.background.start(shell, items, owner, answer, count_tokens)
        if body.stream:  # its events as they are kept: the same a later GET ?stream=true reads
            return EventStream(gw.background.stream(queued, -1), _nothing, routed_headers(answer.headers))
        return JSONResponse(queued.response, headers=routed_headers(answer.headers))
    if isinstance(answer, EventStream):
        events = ResponseEvents(shell, count_tokens)
        return answer.relay(lambda chat_events: _responses_events(events, chat_events, kept))
    if answer.status_code != 200:  # 499: the client left
        return answer
    made = await kept(response_object(shell, json.loads(bytes(answer.body)), count_tokens))
    return JSONResponse(made, headers=routed_headers(answer.headers))


def _owner(gw: GatewayDep, request: Request) -> str:
    """Whom the request's stored responses belong to: its API key's, on a gateway with keys."""
    return owner_of(request.headers.get("authorization")) if gw.settings.api_keys else ""


def _check_background(body: ResponsesRequest, store: ResponseStore | None) -> None:
    if store is None:
        raise invalid(
            "background responses are stored responses, and this gateway keeps none (--responses-ttl 0)",
            "background",
        )
    if body.store is False:
        raise invalid("background responses are stored: leave store out, or set it true", "store")


def _nothing() -> None:
    """What ends a stream of kept events: nothing (the response goes on without its reader)."""


async def _previous(gw: GatewayDep, response_id: str, owner: str) -> StoredResponse:
    store = gw.responses
    if store is None:
        raise invalid(
            "previous_response_id needs stored responses, and this gateway keeps none (--responses-ttl"
            " 0): send the whole conversation in input",
            "previous_response_id",
        )
    previous = await store.load(response_id, owner)
    if previous is None:
        raise ApiError(
            f"Previous response with id {response_id!r} not found: it was made with store false,"
            " deleted, or is older than the gateway keeps responses (--responses-ttl)",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    assert gw.background is not None
    previous = await gw.background.settled(previous)
    if previous.running:
        raise invalid(
            f"Previous response {response_id!r} is {previous.response['status']}: continue it once it has"
            " ended (GET /v1/responses/{id})",
            "previous_response_id",
        )
    return previous


async def _responses_events(
    events: ResponseEvents, chat_events: AsyncIterable[str | bytes], kept: Keep
) -> AsyncIterator[str]:
    try:
        yield events.start()
        async for data in chat_events:
            out = events.feed(data.decode() if isinstance(data, bytes) else data)
            if events.final is not None:  # kept before the last event can name it to the client
                events.final = await kept(events.final)
                out += events.completed()
            if out:
                yield out
    finally:  # the chat events' generator ends with this one (a client gone mid-stream included)
        close = getattr(chat_events, "aclose", None)
        if close is not None:
            await close()


async def _stored(gw: GatewayDep, request: Request, response_id: str) -> StoredResponse:
    store = gw.responses
    found = None if store is None else await store.load(response_id, _owner(gw, request))
    if found is None:
        raise _not_found(store, response_id)
    assert gw.background is not None
    return await gw.background.settled(found)


def _not_found(store: ResponseStore | None, response_id: str) -> ApiError:
    why = "this gateway keeps none (--responses-ttl 0)" if store is None else (
        "it was made with store false, deleted, or is older than the gateway keeps responses (--responses-ttl)"
    )  # fmt: skip
    return ApiError(
        f"No response found with id {response_id!r}: {why}", 404, "not_found_error", "response_id"
    )


@router.get("/v1/responses/{response_id}", response_model=None, responses=api_responses(404, 503))
async def get_response(
    response_id: str,
    request: Request,
    gw: GatewayDep,
    stream: bool = False,
    starting_after: int | None = None,
) -> Response:
    """A stored response, as it was answered (a background one: as it is now); ``stream=true``: a
    background response's events, from its first or from after ``starting_after``, until its last."""
    if starting_after is not None and (not stream or starting_after < 0):
        raise invalid("starting_after is a sequence number (0 or more) to stream from, with stream=true",
                      "starting_after")  # fmt: skip
    found = await _stored(gw, request, response_id)
    if not stream:
        return JSONResponse(found.response)
    if not found.response.get("background"):
        raise invalid("only background responses can be streamed again: leave stream out", "stream")
    assert gw.background is not None
    after = -1 if starting_after is None else starting_after
    return EventStream(gw.background.stream(found, after), _nothing, {})


@router.delete("/v1/responses/{response_id}", response_model=None, responses=api_responses(404, 503))
async def delete_response(response_id: str, request: Request, gw: GatewayDep) -> Response:
    """Forget a stored response (a later turn that kept it in its conversation keeps its copy); a
    background response still running is cancelled."""
    store = gw.responses
    found = await _stored(gw, request, response_id)
    if found.running:
        assert gw.background is not None
        await gw.background.stop(response_id)
    if store is None or not await store.delete(response_id, _owner(gw, request)):
        raise _not_found(store, response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel", response_model=None, responses=api_responses(404, 503))
async def cancel_response(response_id: str, request: Request, gw: GatewayDep) -> Response:
    """Cancel a background response that is queued or in progress (one already cancelled is
    answered as it is); the response, cancelled."""
    found = await _stored(gw, request, response_id)  # a 404 on a gateway that keeps none
    assert gw.background is not None
    return JSONResponse((await gw.background.cancel(found)).response)


@router.get("/v1/responses/{response_id}/input_items", response_model=None, responses=api_responses(404, 503))
async def list_input_items(
    response_id: str,
    request: Request,
    gw: GatewayDep,
    limit: int = 20,
    order: str = "desc",
    after: str | None = None,
    before: str | None = None,
) -> Response:
    """The items a stored response answered, the earlier turns' included (a page of them, newest
    first unless ``order=asc``; ``after`` / ``before``: an item id the page starts after / ends before)."""
    if not 1 <= limit <= 100:
        raise invalid(f"limit must be between 1 and 100, got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise invalid(f"order must be asc or desc, got {order!r}", "order")
    items = (await _stored(gw, request, response_id)).items
    if order == "desc":
        items = items[::-1]
    ids = [item["id"] for item in items]
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise invalid(f"{name}={cursor!r} is not an input item of {response_id!r}", name)
    start = 0 if after is None else ids.index(after) + 1
    end = len(items) if before is None else ids.index(before)
    page = items[start:end][:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + len(page) < end,
        }
    )
