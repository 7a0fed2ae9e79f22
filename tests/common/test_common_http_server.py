"""The HTTP server every service runs its REST endpoints on."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request
from yutu.service import HttpServer


async def test_an_idle_connection_outlives_a_clients_five_second_expiry() -> None:
    """A client idle for 5 s (httpx's, the OpenAI SDK's expiry) may reuse its connection: the
    server must not close it at that moment (uvicorn's default), or the request fails."""
    app = FastAPI()

    @app.get("/port")
    async def port(request: Request) -> int:
        assert request.client is not None
        return request.client.port

    http = HttpServer(app, "127.0.0.1", 0)
    await http.start()
    try:
        limits = httpx.Limits(keepalive_expiry=30)
        async with httpx.AsyncClient(base_url=http.url, limits=limits) as client:
            first = (await client.get("/port")).json()
            await asyncio.sleep(5.5)
            assert (await client.get("/port")).json() == first  # the same connection, still open
    finally:
        await http.stop()
