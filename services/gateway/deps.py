"""Dependencies shared by the route modules (``Annotated`` aliases)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from services.gateway.service import GatewayService


def _gateway(request: Request) -> GatewayService:
    gateway: GatewayService = request.app.state.gateway
    return gateway


GatewayDep = Annotated[GatewayService, Depends(_gateway)]
