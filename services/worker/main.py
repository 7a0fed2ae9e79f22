"""``yutu worker``: an engine process in the mixed role (prefill + decode) on the generate channel.

The same worker core runs ``yutu prefill`` and ``yutu decode`` (services/prefill, services/decode).
"""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial

from yutu.service import HttpServer, admin_app, run_main, serve

from services.worker.service import WorkerService
from services.worker.settings import WorkerSettings
from services.worker.settings import add_arguments as add_role_arguments

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_role_arguments(parser, "mixed")


def run(args: argparse.Namespace) -> int:
    return run_role(args, "mixed")


def run_role(args: argparse.Namespace, role: str) -> int:
    """Run the worker core in ``role`` (mixed, prefill or decode) until SIGINT/SIGTERM."""
    return run_main(args, partial(WorkerSettings.from_args, role=role), _main)


async def _main(settings: WorkerSettings) -> int:
    service = WorkerService(settings)
    await serve(
        service, HttpServer(admin_app(service), settings.host, settings.admin_port, settings.advertise_host)
    )
    failure = service._loop_engine.failure if service._loop_engine is not None else None
    if failure is not None:
        log.error("exiting with status 1: the engine died under the worker (%s)", failure)
        return 1
    return 0


if __name__ == "__main__":  # python -m services.worker.main: the same as `yutu worker`
    from yutu.cli import main

    raise SystemExit(main(["worker", *sys.argv[1:]]))
