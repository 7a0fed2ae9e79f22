"""What /openapi.json says about the answers the gateway really sends.

FastAPI documents a 422 with its own validation-error body on every route that takes a body; the
gateway never sends it (validation failures are 400s in the OpenAI envelope, see errors.py). So
the schema drops the 422 and documents instead, per route, the statuses it does answer, each with
the envelope model (:class:`~services.gateway.schemas.ErrorResponse`), and for the generation
routes both shapes of a 200: the JSON response, or ``text/event-stream`` when ``"stream": true``,
whose events (OpenAPI 3.1: the media type's ``schema`` describes one event) carry as ``data`` a
JSON chunk, an error envelope (a failure after the stream started), or the final ``[DONE]``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from services.gateway.schemas import ErrorResponse

_ERRORS = {
    400: "Invalid request (the envelope's param names the field to change)",
    401: "Missing or wrong API key (when the gateway has --api-key)",
    404: "Unknown model",
    413: "Request body over --max-request-bytes",
    429: "A worker is overloaded: retry later",
    500: "Internal error",
    503: "No worker serving the model is available",
}
_ALWAYS = (400, 401, 404, 500, 503)


def api_responses(*extra: int) -> dict[int | str, dict[str, Any]]:
    """The error statuses every API route may answer, plus ``extra``, each with the envelope model."""
    codes = sorted({*_ALWAYS, *extra})
    return {code: {"model": ErrorResponse, "description": _ERRORS[code]} for code in codes}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def sse_event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream of ``chunk`` objects (see streaming.py)."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
    }


def generation_responses(
    model: type[BaseModel], chunk: type[BaseModel], description: str
) -> dict[int | str, dict[str, Any]]:
    """Responses of a generation route: its 200 as JSON or SSE, and every error it may answer.

    ``chunk`` must also be passed to :func:`install_openapi` (its schema is referenced by name).
    """
    ok: dict[str, Any] = {
        "model": model,
        "description": description,
        "content": {"text/event-stream": {"schema": sse_event_schema(chunk)}},
    }
    return {200: ok, **api_responses(413, 429)}


def install_openapi(app: FastAPI, extra_models: tuple[type[BaseModel], ...]) -> None:
    """Make ``app.openapi()`` drop FastAPI's unsent 422s and define ``extra_models`` (SSE chunks)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for model in extra_models:
            if model.__name__ in components:
                continue
            model_schema = model.model_json_schema(
                ref_template="#/components/schemas/{model}", mode="serialization"
            )
            for name, definition in model_schema.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components[model.__name__] = model_schema
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
