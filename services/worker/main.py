"""``yutu worker``: an engine process (mixed prefill + decode role) on the generate channel."""

from __future__ import annotations

import argparse
import logging
import sys

from yutu.service import HttpServer, admin_app, run_main, serve

from services.worker.service import WorkerService
from services.worker.settings import WorkerSettings
from services.worker.settings import add_arguments as add_arguments

log = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    return run_main(args, WorkerSettings.from_args, _main)


async def _main(settings: WorkerSettings) -> int:
    service = WorkerService(settings)
    await serve(
        service, HttpServer(admin_app(service), settings.host, settings.admin_port, settings.advertise_host)
    )
    failure = service._loop_engine.failure if service._loop_engine is not None else None
    return 1 if failure is not None else 0


if __name__ == "__main__":  # python -m services.worker.main: the same as `yutu worker`
    from yutu.cli import main

    raise SystemExit(main(["worker", *sys.argv[1:]]))
