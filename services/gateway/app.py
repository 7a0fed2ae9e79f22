"""The gateway's HTTP app: the OpenAI API plus /health, /ready, /metrics and /info on one port."""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from yutu.logs import REQUEST_ID as LOG_REQUEST_ID
from yutu.service import admin_app

from services.gateway import routes_chat, routes_completions, routes_models, routes_responses, routes_tokenize
from services.gateway.body_limit import BodyLimit
from services.gateway.errors import install_error_handlers
from services.gateway.memory import ReleaseAfterLargeBodies
from services.gateway.openapi import install_openapi
from services.gateway.schemas import ChatCompletionChunk, CompletionChunk
from services.gateway.service import GatewayService

_ROUTES = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ready",
    "/metrics",
    "/info",
}


_ROUTE_PATTERNS = {"/v1/models/": "/v1/models/{id}", "/v1/responses/": "/v1/responses/{id}"}  # by prefix
_RESPONSE_ACTIONS = ("/input_items", "/cancel")  # /v1/responses/{id}/...


def route_pattern(path: str) -> str:
    """The metric's route label of a path not in _ROUTES: its pattern, or "other"."""
    for prefix, name in _ROUTE_PATTERNS.items():
        if path.startswith(prefix):
            if name == "/v1/responses/{id}":
                for action in _RESPONSE_ACTIONS:
                    if path.endswith(action):
                        return name + action
            return name
    return "other"


class RequestCounter:
    """Counts answered HTTP requests by route and status (pure ASGI: streaming is not buffered)."""

    def __init__(self, app: ASGIApp, gateway: GatewayService) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in _ROUTES else route_pattern(path)
        status = "499"  # the client left before any answer

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        except Exception:
            status = "500"
            raise
        finally:
            self.gateway.metrics_counter_requests(route, status)


REQUEST_ID = "x-request-id"
_MAX_REQUEST_ID = 200  # longer client ids are replaced (they end up in logs and headers)


class RequestId:
    """Every response carries ``x-request-id``: the client's (if it sent a sane one) or a new one.

    The id is in ``scope["state"]["request_id"]`` for the routes (pure ASGI: streaming unbuffered).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ""
        for name, value in scope.get("headers", []):
            if name == REQUEST_ID.encode():
                text = value.decode("latin-1").strip()
                if 0 < len(text) <= _MAX_REQUEST_ID and text.isprintable():
                    request_id = text
        request_id = request_id or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        header = (REQUEST_ID.encode(), request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        token = LOG_REQUEST_ID.set(request_id)  # what the gateway logs for this request names it
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            LOG_REQUEST_ID.reset(token)


def build_app(gateway: GatewayService) -> FastAPI:
    app = admin_app(gateway)
    app.title = "yutu gateway (OpenAI-compatible API)"
    app.state.gateway = gateway
    for module in (routes_models, routes_completions, routes_chat, routes_responses, routes_tokenize):
        app.include_router(module.router)
    install_error_handlers(app)
    install_openapi(app, extra_models=(CompletionChunk, ChatCompletionChunk))
    app.add_middleware(ReleaseAfterLargeBodies, releaser=gateway.memory)  # inside BodyLimit: accepted bodies
    app.add_middleware(BodyLimit, max_bytes=gateway.settings.max_request_bytes)
    app.add_middleware(RequestId)
    app.add_middleware(RequestCounter, gateway=gateway)  # added last: outermost, so it counts the 413s
    return app
