"""``yutu decode``: a decode instance of a disaggregated deployment.

It takes requests with their first token and a KV handle, pulls the KV from the prefill instance
in one batched READ, and streams the rest with continuous batching; a request with a short
uncached prompt it prefills itself. The worker core (services/worker) runs it in the decode role.
"""

from __future__ import annotations

import argparse
import sys

from services.worker.main import run_role
from services.worker.settings import add_arguments as add_role_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_role_arguments(parser, "decode")


def run(args: argparse.Namespace) -> int:
    return run_role(args, "decode")


if __name__ == "__main__":  # python -m services.decode.main: the same as `yutu decode`
    from yutu.cli import main

    raise SystemExit(main(["decode", *sys.argv[1:]]))
