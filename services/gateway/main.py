"""``yutu gateway``: the OpenAI-compatible HTTP front end (tokenization, streaming, API keys)."""

from __future__ import annotations

import argparse
import logging
import sys

from yutu.service import HttpServer, run_main, serve

from services.gateway.settings import GatewaySettings
from services.gateway.settings import add_arguments as add_arguments

log = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    return run_main(args, GatewaySettings.from_args, _main)


async def _main(settings: GatewaySettings) -> int:
    # Imported here so `yutu gateway --help` stays fast (the model source pulls in torch).
    from services.gateway.app import build_app
    from services.gateway.service import GatewayService

    service = GatewayService(settings)
    http = HttpServer(build_app(service), settings.host, settings.port, settings.advertise_host)
    log.info("gateway HTTP API bound on %s:%d", settings.host, http.port)
    await serve(service, http)
    return 0


if __name__ == "__main__":  # python -m services.gateway.main: the same as `yutu gateway`
    from yutu.cli import main

    raise SystemExit(main(["gateway", *sys.argv[1:]]))
