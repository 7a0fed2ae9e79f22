"""``yutu prefill``: a prefill instance of a disaggregated deployment.

It computes each request's first token (reusing its own prefix cache and the KV store) and holds
the request's KV blocks, in registered memory, until the decode instance has pulled them. The
worker core (services/worker) runs it in the prefill role.
"""

from __future__ import annotations

import argparse
import sys

from services.worker.main import run_role
from services.worker.settings import add_arguments as add_role_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_role_arguments(parser, "prefill")


def run(args: argparse.Namespace) -> int:
    return run_role(args, "prefill")


if __name__ == "__main__":  # python -m services.prefill.main: the same as `yutu prefill`
    from yutu.cli import main

    raise SystemExit(main(["prefill", *sys.argv[1:]]))
