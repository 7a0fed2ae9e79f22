"""Dependencies shared by the route modules (``Annotated`` aliases)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from services.gateway.service import GatewayService


async def _gateway(request: Request) -> GatewayService:
    """Async, so FastAPI calls it on the event loop: a plain def runs on its thread pool, a
    thread hop and back for every request."""
    gateway: GatewayService = request.app.state.gateway
    return gateway


GatewayDep = Annotated[GatewayService, Depends(_gateway)]
