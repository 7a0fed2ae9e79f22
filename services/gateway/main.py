"""``yutu gateway``: the OpenAI-compatible HTTP front end (tokenization, streaming, API keys)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from yutu.service import HttpServer, serve, setup_logging

from services.gateway.settings import GatewaySettings
from services.gateway.settings import add_arguments as add_arguments

log = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    try:
        settings = GatewaySettings.from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    setup_logging(settings.log_level)
    return asyncio.run(_main(settings))


async def _main(settings: GatewaySettings) -> int:
    # Imported here so `yutu gateway --help` stays fast (the model source pulls in torch).
    from services.gateway.app import build_app
    from services.gateway.service import GatewayService

    service = GatewayService(settings)
    http = HttpServer(build_app(service), settings.host, settings.port)
    service.http = http
    log.info("gateway HTTP API bound on %s:%d", settings.host, http.port)
    await serve(service, http)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="yutu gateway", description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
