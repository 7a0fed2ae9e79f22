"""Optional API keys: ``Authorization: Bearer <key>`` on the API routes (/health, /ready stay open)."""

from __future__ import annotations

import hmac

from fastapi import Request

from services.gateway.errors import AUTHENTICATION_ERROR, ApiError


def check_api_key(authorization: str | None, keys: tuple[str, ...]) -> None:
    """Raise a 401 ApiError unless ``authorization`` carries one of ``keys`` (no keys: open)."""
    if not keys:
        return
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise ApiError(
            "You didn't provide an API key: send the header `Authorization: Bearer <key>`",
            status=401,
            type=AUTHENTICATION_ERROR,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    # compare_digest against every key, so the time taken does not tell which one nearly matched
    matches = [hmac.compare_digest(token.encode(), key.encode()) for key in keys]
    if not any(matches):
        raise ApiError(
            "Incorrect API key provided: use a key given to the gateway with --api-key (or YUTU_API_KEY)",
            status=401,
            type=AUTHENTICATION_ERROR,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def require_api_key(request: Request) -> None:
    """FastAPI dependency for the API routers."""
    check_api_key(request.headers.get("authorization"), request.app.state.gateway.settings.api_keys)
