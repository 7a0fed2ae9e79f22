"""``yutu conductor``: the KV-cache-centric global scheduler of a disaggregated deployment."""

from __future__ import annotations

import argparse
import sys

from yutu.service import HttpServer, admin_app, run_main, serve

from services.conductor.service import ConductorService
from services.conductor.settings import ConductorSettings
from services.conductor.settings import add_arguments as add_arguments


def run(args: argparse.Namespace) -> int:
    return run_main(args, ConductorSettings.from_args, _main)


async def _main(settings: ConductorSettings) -> int:
    service = ConductorService(settings)
    await serve(
        service, HttpServer(admin_app(service), settings.host, settings.admin_port, settings.advertise_host)
    )
    return 0


if __name__ == "__main__":  # python -m services.conductor.main: the same as `yutu conductor`
    from yutu.cli import main

    raise SystemExit(main(["conductor", *sys.argv[1:]]))
