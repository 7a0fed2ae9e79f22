"""``yutu worker``: an engine process (mixed prefill + decode role) on the generate channel."""

from __future__ import annotations

import argparse
import asyncio
import logging

from yutu.service import HttpServer, admin_app, serve, setup_logging

from services.worker.service import WorkerService
from services.worker.settings import WorkerSettings
from services.worker.settings import add_arguments as add_arguments

log = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    try:
        settings = WorkerSettings.from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    setup_logging(settings.log_level)
    return asyncio.run(_main(settings))


async def _main(settings: WorkerSettings) -> int:
    service = WorkerService(settings)
    http = HttpServer(admin_app(service), settings.host, settings.admin_port)
    service.http = http
    await serve(service, http)
    failure = service._loop_engine.failure if service._loop_engine is not None else None
    return 1 if failure is not None else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="yutu worker", description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
